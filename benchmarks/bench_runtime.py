"""Runtime speed against transformers and against the physical floor, measured in one run.

    .venv/bin/python benchmarks/bench_runtime.py [--dtype bfloat16] [--threads 2] [--batches 1,8,32,64]
                                                 [--context 8] [--long-context 512]

For each decode batch size it prints: the runtime's decode step time, the time of the
same weight matmuls alone (the floor for a torch runtime), the memory roofline (weight
bytes / measured read bandwidth), transformers `generate` throughput, and the ratios;
then the same for batch 32 after long prompts, where attention over the cache weighs in.
Then prefill throughput for a 512-token prompt, runtime vs transformers.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def read_bandwidth_gbs() -> float:
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MiB
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_floor(engine: Engine, batch: int):
    """A callable running one decode step's weight matmuls alone, in the model's order, dtype and form
    (packed on CPU)."""
    model = engine.runner.model
    linears = [lin for layer in model.layers for lin in layer.linears()] + [model.lm_head]
    x = {lin.shape[1]: torch.randn(batch, lin.shape[1], dtype=model.dtype) for lin in linears}

    def step():
        for lin in linears:
            lin(x[lin.shape[1]])

    step()
    return step


def weight_bytes(engine: Engine) -> int:
    model = engine.runner.model
    return sum(lin.nbytes for layer in model.layers for lin in layer.linears()) + model.lm_head.nbytes


def prompt(i: int, length: int) -> list[int]:
    """Distinct prompts per row (no prefix sharing between rows), `length` tokens each."""
    head = [1, 504, 3300 + i, 42, 9, 17, 88, 11]
    return (head + [(31 * k + 7 * i) % 40000 + 100 for k in range(length)])[:length]


def runtime_decode_step_s(engine: Engine, batch: int, new_tokens: int, context: int) -> tuple[float, float]:
    """Median decode step and median matmul floor, the floor timed right after each step so that both
    see the same machine (a shared host's speed drifts from second to second)."""
    floor = matmul_floor(engine, batch)
    for i in range(batch):
        engine.add_request(Req(rid=f"b{batch}-{i}", input_ids=prompt(i, context),
                               params=SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)))
    steps, floors = [], []
    while engine.has_work():
        decoding = not engine.scheduler.waiting and engine.scheduler.chunked is None
        engine.step()
        if decoding and engine.scheduler.running and len(engine.scheduler.running) == batch:
            steps.append(engine.stats.last_step_s)
            floors.append(_timed(floor))
    engine.flush_cache()
    return statistics.median(steps[2:]), statistics.median(floors[2:])


def hf_generate_tok_s(model, batch: int, new_tokens: int, context: int) -> float:
    """transformers `generate` decode throughput: a run of `new_tokens` minus a run of one (its prefill), so
    that long prompts count against neither side."""
    ids = torch.tensor([prompt(i, context) for i in range(batch)])

    def generate(n: int) -> float:
        return _timed(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                             pad_token_id=2))

    model.generate(ids[:, :4], max_new_tokens=2, do_sample=False, pad_token_id=2)  # warm-up
    return batch * (new_tokens - 1) / (generate(new_tokens) - generate(1))


def runtime_prefill_s(engine: Engine, tokens: int) -> float:
    times = []
    for rep in range(3):
        engine.flush_cache()
        engine.add_request(Req(rid=f"p{rep}", input_ids=[(7 * k + rep) % 40000 + 100 for k in range(tokens)],
                               params=SamplingParams(temperature=0, max_new_tokens=1)))
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        times.append(time.perf_counter() - t0)
    return min(times)


def hf_prefill_s(model, tokens: int) -> float:
    ids = torch.tensor([[(7 * k) % 40000 + 100 for k in range(tokens)]])
    with torch.no_grad():
        model(ids)
        return min(_timed(lambda: model(ids)) for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, choices=["w8a8_int8"],
                    help="the runtime's matmuls in int8 (the floor is then its int8 matmuls)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=8, help="prompt tokens per sequence in the decode rows")
    ap.add_argument("--long-context", type=int, default=512,
                    help="one more row: batch 32 decoding after prompts this long (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(None)
    engine = Engine(RuntimeConfig(model_path=str(model_dir), dtype=args.dtype, quantization=args.quantization,
                                  cache=CacheConfig(page_size=16, max_total_tokens=65536),
                                  scheduler=SchedulerConfig(max_running_requests=256, chunked_prefill_size=4096,
                                                            max_prefill_tokens=16384)))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).eval()
    bw = read_bandwidth_gbs()
    wbytes = weight_bytes(engine)
    print(f"model {model_dir.name}, {args.dtype}{', ' + args.quantization if args.quantization else ''}, "
          f"{args.threads} threads; weights {wbytes / 1e6:.0f} MB; "
          f"read bandwidth {bw:.1f} GB/s; roofline {wbytes / bw / 1e6:.1f} ms/step")
    print(f"{'batch':>5} {'context':>7} {'step ms':>8} {'floor ms':>8} {'step/floor':>10} {'tok/s':>8} "
          f"{'hf tok/s':>8} {'vs hf':>6}")
    rows = [(int(b), args.context) for b in args.batches.split(",")]
    rows += [(32, args.long_context)] if args.long_context else []
    for batch, context in rows:
        step, floor = runtime_decode_step_s(engine, batch, args.new_tokens, context)
        hf_tps = hf_generate_tok_s(hf, batch, args.new_tokens, context)
        tps = batch / step
        print(f"{batch:>5} {context:>7} {step * 1e3:>8.1f} {floor * 1e3:>8.1f} {step / floor:>10.2f} {tps:>8.1f} "
              f"{hf_tps:>8.1f} {tps / hf_tps:>6.2f}")
    ours, theirs = runtime_prefill_s(engine, 512), hf_prefill_s(hf, 512)
    print(f"prefill 512 tokens: runtime {ours:.3f} s ({512 / ours:.0f} tok/s), transformers {theirs:.3f} s "
          f"({512 / theirs:.0f} tok/s), ratio {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
