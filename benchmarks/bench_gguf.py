"""`--quantization gguf` on the default model (its shipped Q4_1 GGUF served as stored) against the same model in
bf16 and in w8a8_int8: weight bytes read per token, the decode step at batch 1 and 32, greedy agreement.

    .venv/bin/python benchmarks/bench_gguf.py [--model-path FILE.gguf] [--rounds 3] [--threads 2] [--batches 1,32]

The three engines run in one process and are measured in alternation, round after round (a shared host's speed
drifts from minute to minute); each figure is the median over rounds of each round's median step. The load
average is printed with them: on a loaded machine read the ratios, not the absolutes. Greedy agreement: for
each parity prompt, the first position where the 4-bit model's tokens differ from bf16's (the bf16 model holds
the same weights dequantized, rounded to bf16).
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
from bench_int8 import QUESTIONS, decode_step_ms, first_difference, greedy

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import default_gguf, resolve_model_path

KINDS = (("bf16", None), ("w8a8_int8", "w8a8_int8"), ("gguf", "gguf"))


def make_engine(model_dir: str, quantization: str | None) -> Engine:
    """A bf16 engine with a pool for this load only: three of them live side by side."""
    return Engine(RuntimeConfig(model_path=model_dir, dtype="bfloat16", quantization=quantization,
                                cache=CacheConfig(page_size=16, max_total_tokens=4096),
                                scheduler=SchedulerConfig(max_running_requests=64, chunked_prefill_size=2048,
                                                          max_prefill_tokens=2048)))


def weight_mb(engine: Engine) -> float:
    """Bytes a decode step reads from the weight matrices and the LM head."""
    model = engine.runner.model
    return (sum(lin.nbytes for layer in model.layers for lin in layer.linears()) + model.lm_head.nbytes) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="a .gguf file (default: the shipped Q4_1 SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = args.model_path or str(default_gguf())
    model_dir = str(resolve_model_path(gguf, quiet=True))
    engines = {name: make_engine(model_dir, quant) for name, quant in KINDS}
    batches = [int(b) for b in args.batches.split(",")]
    steps: dict[tuple[str, int], list[float]] = {(name, b): [] for name, _ in KINDS for b in batches}
    loads = []
    for r in range(args.rounds):
        for batch in batches:
            for name, engine in engines.items():
                steps[name, batch].append(decode_step_ms(engine, batch))
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{name} batch {b} {steps[name, b][-1]:.1f} ms" for (name, b) in steps),
              flush=True)
    print(f"{os.path.basename(gguf)}, {args.threads} threads, {args.rounds} alternating rounds, "
          f"1-min load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'weights':<10} {'MB/token':>9}" + "".join(f" {f'batch {b} step':>14} {'tok/s':>8}" for b in batches))
    for name, engine in engines.items():
        row = f"{name:<10} {weight_mb(engine):9.1f}"
        for b in batches:
            ms = statistics.median(steps[name, b])
            row += f" {ms:11.2f} ms {b / ms * 1e3:8.1f}"
        print(row)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    base, four = greedy(engines["bf16"], prompts, args.new_tokens), greedy(engines["gguf"], prompts, args.new_tokens)
    print(f"\ngreedy, {args.new_tokens} tokens: first position where gguf's output differs from bf16's")
    for q, a, b in zip(QUESTIONS, base, four):
        d = first_difference(a, b)
        print(f"  {q[:60]:<60} {'identical' if d is None else d:>10}")


if __name__ == "__main__":
    main()
