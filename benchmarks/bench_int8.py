"""`--quantization w8a8_int8` on a decoder: greedy agreement with the unquantized model, and step times.

    .venv/bin/python benchmarks/bench_int8.py [--model-path DIR] [--new-tokens 64] [--threads 2]

Greedy output of the default dtype (bf16 where the CPU has bf16 instructions, else fp32) and of the same model
quantized, on the parity prompts of tests/shared/test_greedy_default_model.py and a few longer ones: for each
prompt, the first position where the two differ ("identical" when none does within --new-tokens). fp32 against
the default dtype is printed beside it, for the scale of a change of rounding alone. Then the decode step at
batch 1 and 32, quantized against unquantized, measured in the same run (serving figures:
benchmarks/bench_serving.py --servers colocated,colocated-int8).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits and their colors.",
    "Give me a recipe for pancakes with all the steps in detail, including the ingredients and their amounts.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the differences between a list and a tuple in Python?",
]


def make_engine(model_dir: str, dtype: str, quantization: str | None) -> Engine:
    return Engine(RuntimeConfig(model_path=model_dir, dtype=dtype, quantization=quantization,
                                cache=CacheConfig(page_size=16, max_total_tokens=32768),
                                scheduler=SchedulerConfig(max_running_requests=64, chunked_prefill_size=4096,
                                                          max_prefill_tokens=8192)))


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(Req(rid=f"g{i}", input_ids=ids,
                               on_output=lambda o: out.setdefault(o.rid, []).extend(o.token_ids),
                               params=SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    engine.flush_cache()
    return [out[f"g{i}"] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def decode_step_ms(engine: Engine, batch: int, new_tokens: int = 24) -> float:
    for i in range(batch):
        engine.add_request(Req(rid=f"s{batch}-{i}", input_ids=[1, 504, 3300 + i, 42, 9, 17, 88, 11],
                               params=SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)))
    steps = []
    while engine.has_work():
        decoding = not engine.scheduler.waiting and engine.scheduler.chunked is None
        engine.step()
        if decoding and len(engine.scheduler.running) == batch:
            steps.append(engine.stats.last_step_s)
    engine.flush_cache()
    return statistics.median(steps[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = str(resolve_model_path(args.model_path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    plain = make_engine(model_dir, "auto", None)
    dtype = str(plain.runner.dtype).replace("torch.", "")
    quantized = make_engine(model_dir, "auto", "w8a8_int8")
    fp32 = make_engine(model_dir, "float32", None)
    base = greedy(plain, prompts, args.new_tokens)
    int8 = greedy(quantized, prompts, args.new_tokens)
    wide = greedy(fp32, prompts, args.new_tokens)
    print(f"greedy, {args.new_tokens} tokens: first position where the output differs from {dtype}'s")
    print(f"{'prompt':<44} {'w8a8_int8':>10} {'float32':>8}")
    for q, a, b, c in zip(QUESTIONS, base, int8, wide):
        d8, d32 = first_difference(a, b), first_difference(a, c)
        print(f"{q[:44]:<44} {'identical' if d8 is None else d8:>10} {'identical' if d32 is None else d32:>8}")
    print(f"\ndecode step ({dtype} vs w8a8_int8, {args.threads} threads)")
    for batch in (1, 32):
        a, b = decode_step_ms(plain, batch), decode_step_ms(quantized, batch)
        print(f"  batch {batch:>2}: {a:6.1f} ms vs {b:6.1f} ms  ratio {b / a:.2f}")


if __name__ == "__main__":
    main()
