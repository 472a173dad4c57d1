"""The runtime on a CUDA GPU with the Triton kernels, against transformers on the same GPU.

    python benchmarks/gpu_runtime.py [--model-path DIR]

Without --model-path it builds a random-weight model of SmolLM2-135M's shape (no
download needed). Prints (1) whether greedy output of the runtime (triton backend)
equals transformers' greedy `generate`, token for token, in fp32; (2) decode step
time and throughput at batch 1, 8, 32, 64 in bf16 against transformers `generate`.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams


def smollm_shaped(out_dir: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper than the default init, so greedy choices are not near-ties
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(out_dir)
    return out_dir


def engine_for(model_dir: str, dtype: str) -> Engine:
    return Engine(RuntimeConfig(model_path=model_dir, dtype=dtype, device="cuda", attention_backend="triton",
                                cache=CacheConfig(page_size=16, max_total_tokens=131072),
                                scheduler=SchedulerConfig(max_running_requests=256, max_prefill_tokens=16384)))


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(Req(rid=str(i), input_ids=ids, on_output=lambda o: out.setdefault(o.rid, []).extend(o.token_ids),
                               params=SamplingParams(temperature=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens)))
    while engine.has_work():
        engine.step()
    assert engine.scheduler.check_integrity().ok
    return [out[str(i)] for i in range(len(prompts))]


def greedy_check(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[1] + [(37 * k + 11 * i) % 40000 + 50 for k in range(n)] for i, n in enumerate((7, 33, 90, 250))]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    want = []
    with torch.no_grad():
        for ids in prompts:
            g = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                            pad_token_id=2)
            want.append(g[0, len(ids):].tolist())
    got = run(engine_for(model_dir, "float32"), prompts, 64)
    same = sum(a == b for a, b in zip(got, want))
    first_diff = [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, want)]
    print(f"greedy fp32, triton backend, 4 prompts x 64 tokens batched: {same}/4 identical to transformers "
          f"(first differing position per prompt: {first_diff})")


def speed(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    engine = engine_for(model_dir, "bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>9} {'hf tok/s':>9} {'vs hf':>6}")
    for batch in (1, 8, 32, 64):
        prompts = [[1, 500 + i, 42, 9, 17, 88, 11, 7] for i in range(batch)]
        run(engine, prompts, 4)  # warm-up
        engine.flush_cache()
        for i, ids in enumerate(prompts):
            engine.add_request(Req(rid=f"s{i}", input_ids=ids,
                                   params=SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)))
        steps = []
        while engine.has_work():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            decoding = not engine.scheduler.waiting and engine.scheduler.running
            engine.step()
            torch.cuda.synchronize()
            if decoding:
                steps.append(time.perf_counter() - t0)
        engine.flush_cache()
        step = sorted(steps)[len(steps) // 2]
        ids = torch.tensor(prompts, device="cuda")
        hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=2)
        torch.cuda.synchronize()
        hf_tps = batch * 64 / (time.perf_counter() - t0)
        print(f"{batch:>5} {step * 1e3:>8.2f} {batch / step:>9.0f} {hf_tps:>9.0f} {batch / step / hf_tps:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_path or smollm_shaped(tmp)
        greedy_check(model_dir)
        speed(model_dir)


if __name__ == "__main__":
    main()
