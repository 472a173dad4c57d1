"""Does the default mode give the same answer to the same request whatever runs beside it?

    .venv/bin/python benchmarks/bench_consistency.py [--trials 20] [--new-tokens 32] [--threads 2]
                                                     [--deterministic]

For each parity prompt (benchmarks/bench_int8.py) and two kinds of request, greedy and seeded sampling (the
multi-turn example's parameters: temperature 0.3, top_p 0.95, a frequency penalty, seed 42), a reference answer
on a cold cache, then --trials trials of each situation: a cold start (cache flushed), a warm prefix cache (the
same prompt just ran) and a busy batch (3-6 other prompts, some joining while it decodes). Prints how many
trials gave the reference's tokens exactly; for the others, the first position that differs and the reference's
fp32 margin there (top-1 minus top-2 logprob): a near-tie that a change of summation order can flip. Without
--deterministic the layers pick kernels by row count (GEMV, oneDNN, tiled attention), so bits may move while
the fp32 logits keep the answers; with it every trial must match.
"""
from __future__ import annotations

import argparse
import random

import torch

from bench_int8 import QUESTIONS
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

KINDS = {"greedy": dict(temperature=0),
         "seeded": dict(temperature=0.3, top_p=0.95, frequency_penalty=0.2, seed=42)}
SITUATIONS = ("cold", "warm", "busy")


def answer(engine: Engine, prompt: list[int], kind: str, new_tokens: int, others: list[list[int]] = (),
           join_after: int = 3) -> tuple[list[int], list[float]]:
    """The tokens of `prompt` and the margin (top-1 minus top-2 logprob) at each, with `others` beside it (half
    of them from the start, the rest joining after `join_after` steps)."""
    out: dict[str, list] = {}

    def collect(o):
        for t, lp in zip(o.token_ids, o.logprobs):
            out.setdefault(o.rid, []).append((t, lp.top_logprobs[0] - lp.top_logprobs[1]))

    def add(rid: str, ids: list[int], params: dict) -> None:
        engine.add_request(Req(rid=rid, input_ids=ids, on_output=collect,
                               params=SamplingParams(**params, max_new_tokens=new_tokens, ignore_eos=True,
                                                     return_logprob=True, top_logprobs_num=2)))

    half = len(others) // 2
    for i, ids in enumerate(others[:half]):
        add(f"o{i}", ids, KINDS["greedy"])
    add("a", prompt, KINDS[kind])
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == join_after:
            for i, ids in enumerate(others[half:]):
                add(f"l{i}", ids, KINDS["seeded"])
    got = out["a"]
    return [t for t, _ in got], [m for _, m in got]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = str(resolve_model_path(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    engine = Engine(RuntimeConfig(model_path=model_dir, deterministic=args.deterministic,
                                  cache=CacheConfig(page_size=16, max_total_tokens=32768),
                                  scheduler=SchedulerConfig(max_running_requests=64, chunked_prefill_size=4096,
                                                            max_prefill_tokens=8192)))
    rng = random.Random(0)
    print(f"{'default' if not args.deterministic else 'deterministic'} mode, {engine.runner.dtype}, "
          f"{args.trials} trials per situation, {args.new_tokens} tokens; identical trials per situation")
    print(f"{'prompt':<40} {'kind':<7} " + " ".join(f"{s:>5}" for s in SITUATIONS) + "  differences")
    total = same = 0
    for q, prompt in zip(QUESTIONS, prompts):
        for kind in KINDS:
            engine.flush_cache()
            ref, margins = answer(engine, prompt, kind, args.new_tokens)
            counts, notes = [], set()
            for situation in SITUATIONS:
                ok = 0
                for _ in range(args.trials):
                    others = []
                    if situation == "warm":
                        answer(engine, prompt, kind, 1)
                    else:
                        engine.flush_cache()
                    if situation == "busy":
                        others = rng.sample([p for p in prompts if p is not prompt], rng.randint(3, 6))
                    got, _ = answer(engine, prompt, kind, args.new_tokens, others, rng.randint(1, 6))
                    at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
                    if at is None:
                        ok += 1
                    else:
                        notes.add(f"{situation}@{at} margin {margins[at]:.4f}")
                counts.append(ok)
                total, same = total + args.trials, same + ok
            print(f"{q[:40]:<40} {kind:<7} " + " ".join(f"{c:>5}" for c in counts) + "  " + "; ".join(sorted(notes)))
    print(f"identical: {same} of {total} trials")


if __name__ == "__main__":
    main()
