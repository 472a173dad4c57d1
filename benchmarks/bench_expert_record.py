"""Cost of expert-distribution recording: engine decode steps with and without it, alternating, same run.

    .venv/bin/python benchmarks/bench_expert_record.py [--batch 32] [--rounds 10] [--steps 20] [--threads 2]
        [--dtype bfloat16] [--device cpu]

Builds a random Qwen2-MoE checkpoint with transformers (8 experts, top-2, hidden 256, 4 layers, a shared
expert), runs `--batch` requests into steady decode on an in-process Engine, then times `--steps` decode steps
per block, blocks alternating between not recording and recording (start ... stop + dump), in ABBA order over
`--rounds` rounds so the machine's drift and the growing context hit both alike. Prints the median step time of
each, the median over rounds of each round's recording/not ratio (the throughput recording costs, target
< 3 %), and the hook's own time per step (its index_add_ per expert layer, timed alone): the part of the
difference that is not the machine's noise.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams


def make_model(out_dir: Path, dtype: torch.dtype) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2MoeConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                               shared_expert_intermediate_size=512, norm_topk_prob=False, eos_token_id=2,
                               tie_word_embeddings=False)
    model = tf.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routing that prefers some experts, as trained routers do
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


def timed_steps(engine: Engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def hook_cost_s(engine: Engine, batch: int, reps: int = 2000) -> float:
    """The recording hook's time per decode step: one call per expert layer on a [batch, 2] choice."""
    from pdserve.shared.expert_recorder import ExpertRecorder

    mc = engine.model_config
    recorder = ExpertRecorder(mc.num_layers, mc.moe.num_experts, engine.runner.device)
    ids = torch.randint(0, mc.moe.num_experts, (batch, mc.moe.top_k), device=engine.runner.device)
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        for layer in mc.moe.sparse_layers:
            recorder.record(layer, ids)
    sync()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20, help="decode steps per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-experts-") as tmp:
        model_dir = make_model(Path(tmp), dtype)
        total_steps = 2 * args.rounds * args.steps + 8
        engine = Engine(RuntimeConfig(model_path=str(model_dir), dtype=args.dtype, device=args.device,
                                      cache=CacheConfig(page_size=16,
                                                        max_total_tokens=args.batch * (total_steps + 64)),
                                      scheduler=SchedulerConfig(max_running_requests=args.batch)))
        params = SamplingParams(temperature=0, max_new_tokens=total_steps + 16, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(Req(rid=str(i), input_ids=[(37 * i + 11 * k) % 2000 + 10 for k in range(16)],
                                   params=params))
        while engine.scheduler.waiting or len(engine.scheduler.running) < args.batch:
            engine.step()  # prefill
        timed_steps(engine, 8)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        ratios = []
        for r in range(args.rounds):
            block = {}
            for recording in ((False, True) if r % 2 == 0 else (True, False)):
                if recording:
                    engine.experts.start()
                block[recording] = timed_steps(engine, args.steps)
                times[recording] += block[recording]
                if recording:
                    engine.experts.stop()
                    counts = engine.experts.dump()
                    assert counts.sum().item() == args.steps * args.batch * 2 * 4  # top-2, 4 expert layers
            ratios.append(statistics.median(block[True]) / statistics.median(block[False]))
        hook_s = hook_cost_s(engine, args.batch)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"Qwen2-MoE random (8 experts, top-2, hidden 256, 4 layers), {args.dtype}, {args.device}, "
          f"{args.threads} threads, batch {args.batch} decode, {args.rounds} rounds x {args.steps} steps each")
    print(f"not recording: {off * 1e3:.3f} ms/step ({args.batch / off:,.0f} tok/s)")
    print(f"recording:     {on * 1e3:.3f} ms/step ({args.batch / on:,.0f} tok/s)")
    print(f"step time recording/not, median of {args.rounds} rounds: {statistics.median(ratios):.3f} "
          f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}; target < 1.03)")
    print(f"the hook alone: {hook_s * 1e6:.1f} us per step = {100 * hook_s / off:.2f} % of a step")


if __name__ == "__main__":
    main()
