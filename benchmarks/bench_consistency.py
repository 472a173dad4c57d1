"""Does the default mode give the same answer to the same request whichever process computes it, whatever it
finds cached, whatever runs beside it?

    .venv/bin/python benchmarks/bench_consistency.py [--trials 10] [--cold-processes 3] [--new-tokens 32]
                                                     [--prompts 8] [--threads 2] [--deterministic]

Cases: the eight parity prompts (benchmarks/bench_int8.py) and the seeds' multi-turn example (a system message, a
question about ancient Rome, an answer, a follow-up), each greedy and seeded (temperature 0.3, top_p 0.95,
frequency and presence penalties 0.2, seed 42). The reference: each case answered by this process's engine on
an empty cache. Then trials, each computed otherwise than the reference, so that each could differ from it:
- cold: a fresh process (--cold-processes of them: its own engine, model load and kernel choices), empty cache;
- warm: a prefix of the prompt cached by an earlier request (its length drawn from 8 tokens to the whole
  prompt), the rest computed over the cached KV with other row counts;
- busy: beside 3-6 other prompts, half of them joining while it decodes (other row counts in every layer,
  decode attention over a batch).
Prints per case how many trials gave the reference's tokens exactly and, for each that did not, the situation,
the first differing position, the margin there and the measured change that crossed it. Greedy: the
reference's gap between its top two logits, against the largest change of a logit between the two runs.
Seeded: the smaller of the distance from the position's uniform to the nearest edge of the sampled token's share
of the cumulative distribution, and of the gap between top_p and the mass of the tokens likelier than it, both
in probability; against the largest change of a token's probability (temperature and penalties applied, over
the 64 likeliest tokens). A flip whose margin is larger than the change is not explained by arithmetic.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile

import torch

from bench_int8 import QUESTIONS
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path
from pdserve.shared.req import Req
from pdserve.shared.sampler import make_generator
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.seeded_draws import position_generator

KINDS = {"greedy": dict(temperature=0),
         "seeded": dict(temperature=0.3, top_p=0.95, frequency_penalty=0.2, presence_penalty=0.2, seed=42)}
ROME = [{"role": "system", "content": "You are a knowledgeable historian who provides concise responses."},
        {"role": "user", "content": "Tell me about ancient Rome"},
        {"role": "assistant", "content": "Ancient Rome was a civilization centered in Italy."},
        {"role": "user", "content": "What were their major achievements?"}]
TOP = 64  # logits kept per step: at temperature 0.3 the rest hold no measurable probability


def conversations() -> list[tuple[str, list[dict]]]:
    return [(q, [{"role": "user", "content": q}]) for q in QUESTIONS] + [("multi-turn: Rome's achievements", ROME)]


def make_engine(threads: int, deterministic: bool) -> tuple[Engine, list[tuple[str, list[int]]]]:
    from transformers import AutoTokenizer

    torch.set_num_threads(threads)
    model_dir = str(resolve_model_path(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [(name, tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)) for name, messages in conversations()]
    engine = Engine(RuntimeConfig(model_path=model_dir, deterministic=deterministic,
                                  cache=CacheConfig(page_size=16, max_total_tokens=32768),
                                  scheduler=SchedulerConfig(max_running_requests=64, chunked_prefill_size=4096,
                                                            max_prefill_tokens=8192)))
    return engine, prompts


def cases(prompts: list[tuple[str, list[int]]], count: int) -> list[tuple[str, list[int]]]:
    """The first `count` parity prompts and the multi-turn example (the last); every prompt may run beside them."""
    return prompts[:count] + prompts[-1:]


class Answer:
    """The tracked request's tokens and, per position, its 64 largest raw logits (values, token ids)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []


def answer(engine: Engine, prompt: list[int], kind: str, new_tokens: int, others: list[list[int]] = (),
           join_after: int = 3) -> Answer:
    """`prompt` answered with `others` beside it (half from the start, the rest joining after `join_after`
    steps); its logits are read where the sampler reads them."""
    got, params = Answer(), SamplingParams(**KINDS[kind], max_new_tokens=new_tokens, ignore_eos=True)
    sample = engine.sampler.sample

    def tracking(logits, rows_params, *rest):
        for i, p in enumerate(rows_params):
            if p is params:
                values, ids = logits[i].float().topk(TOP)
                got.rows.append((values, ids))
        return sample(logits, rows_params, *rest)

    def add(rid: str, ids: list[int], p: SamplingParams) -> None:
        on_output = (lambda o: got.tokens.extend(o.token_ids)) if rid == "a" else None
        engine.add_request(Req(rid=rid, input_ids=ids, params=p, on_output=on_output))

    engine.sampler.sample = tracking
    try:
        half = len(others) // 2
        for i, ids in enumerate(others[:half]):
            add(f"o{i}", ids, SamplingParams(**KINDS["greedy"], max_new_tokens=new_tokens))
        add("a", prompt, params)
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            if steps == join_after:
                for i, ids in enumerate(others[half:]):
                    add(f"l{i}", ids, SamplingParams(**KINDS["seeded"], max_new_tokens=new_tokens))
    finally:
        engine.sampler.sample = sample
    return got


def penalised(values: torch.Tensor, ids: torch.Tensor, before: list[int]) -> torch.Tensor:
    """The seeded kind's frequency and presence penalties on the kept logits, given the tokens output before."""
    p = KINDS["seeded"]
    counts = torch.tensor([before.count(t) for t in ids.tolist()], dtype=torch.float32)
    return values - p["frequency_penalty"] * counts - p["presence_penalty"] * (counts > 0)


def probabilities(values: torch.Tensor, ids: torch.Tensor, before: list[int]) -> dict[int, float]:
    x = penalised(values, ids, before) / KINDS["seeded"]["temperature"]
    return dict(zip(ids.tolist(), torch.softmax(x, 0).tolist()))


def margin(ref: Answer, at: int, kind: str) -> float | None:
    """How far the reference's draw at `at` was from going otherwise (see the module's text); None where the
    seeded draw was redrawn (its first token fell outside the nucleus), which this does not follow."""
    values, ids = ref.rows[at]
    if kind == "greedy":
        return (values[0] - values[1]).item()
    probs = probabilities(values, ids, ref.tokens[:at])
    order = sorted(probs)  # vocabulary order, as the sampler's cumulative sum runs
    seed = KINDS["seeded"]["seed"]
    u = torch.rand(1, generator=position_generator(make_generator(seed), seed, at)).item()
    total = 0.0
    for token in order:
        if total + probs[token] > u:
            break
        total += probs[token]
    edge = min(u - total, total + probs[token] - u)
    likelier = sum(p for p in probs.values() if p > probs[token])
    nucleus = KINDS["seeded"]["top_p"] - likelier
    return None if nucleus <= 0 else min(edge, nucleus)


def change(ref: Answer, got: Answer, at: int, kind: str) -> float:
    """The largest change, between the two runs at position `at` (same tokens before it), of a logit (greedy)
    or of a token's probability (seeded)."""
    (rv, ri), (gv, gi) = ref.rows[at], got.rows[at]
    if kind == "greedy":
        a, b = dict(zip(ri.tolist(), rv.tolist())), dict(zip(gi.tolist(), gv.tolist()))
        return max(abs(a[t] - b[t]) for t in a.keys() & b.keys())
    a, b = probabilities(rv, ri, ref.tokens[:at]), probabilities(gv, gi, ref.tokens[:at])
    return max(abs(a.get(t, 0.0) - b.get(t, 0.0)) for t in a.keys() | b.keys())


def cold_child(path: str, threads: int, deterministic: bool, new_tokens: int, count: int) -> None:
    engine, prompts = make_engine(threads, deterministic)
    out = {}
    for name, prompt in cases(prompts, count):
        for kind in KINDS:
            engine.flush_cache()
            got = answer(engine, prompt, kind, new_tokens)
            out[(name, kind)] = (got.tokens, got.rows)
    torch.save(out, path)


def cold_answers(args) -> list[dict]:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.cold_processes):
            path = os.path.join(tmp, f"cold{i}.pt")
            cmd = [sys.executable, __file__, "--cold-child", path, "--threads", str(args.threads),
                   "--new-tokens", str(args.new_tokens), "--prompts", str(args.prompts)] + (["--deterministic"] if args.deterministic else [])
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs.append(torch.load(path))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10, help="warm and busy trials per case")
    ap.add_argument("--cold-processes", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS), help="parity prompts (the multi-turn example "
                                                                        "always runs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--cold-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_child:
        cold_child(args.cold_child, args.threads, args.deterministic, args.new_tokens, args.prompts)
        return
    colds = cold_answers(args)
    engine, prompts = make_engine(args.threads, args.deterministic)
    from pdserve.shared import linear

    rng = random.Random(0)
    print(f"{'deterministic' if args.deterministic else 'default'} mode, {engine.runner.dtype}, bf16 layers on "
          f"{'the fixed-order kernel' if linear.fixed_order_pays() else 'oneDNN'}, the LM head on "
          f"{'the fixed-order kernel' if linear.fixed_order_head_pays() else 'oneDNN'}; {args.new_tokens} tokens; "
          f"cold: {args.cold_processes} fresh processes, warm and busy: {args.trials} trials each")
    print(f"{'case':<34} {'kind':<7} {'cold':>5} {'warm':>6} {'busy':>6}  differences: situation@position "
          "margin vs change")
    totals = {s: [0, 0] for s in ("cold", "warm", "busy")}
    for name, prompt in cases(prompts, args.prompts):
        for kind in KINDS:
            engine.flush_cache()
            ref = answer(engine, prompt, kind, args.new_tokens)
            trials: list[tuple[str, Answer]] = []
            for run in colds:
                got = Answer()
                got.tokens, got.rows = run[(name, kind)]
                trials.append(("cold", got))
            for _ in range(args.trials):
                engine.flush_cache()
                cached = rng.randint(8, len(prompt))
                answer(engine, prompt[:cached], kind, 1)
                trials.append((f"warm({cached}/{len(prompt)})", answer(engine, prompt, kind, args.new_tokens)))
            for _ in range(args.trials):
                engine.flush_cache()
                others = rng.sample([p for n, p in prompts if n != name], rng.randint(3, 6))
                trials.append(("busy", answer(engine, prompt, kind, args.new_tokens, others, rng.randint(1, 6))))
            counts, notes = {s: 0 for s in totals}, []
            for situation, got in trials:
                group = situation.split("(")[0]
                totals[group][1] += 1
                at = next((i for i, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
                if at is None:
                    counts[group] += 1
                    totals[group][0] += 1
                    continue
                m = margin(ref, at, kind)
                shown = "redrawn" if m is None else f"{m:.4f}"
                notes.append(f"{situation}@{at} {shown} vs {change(ref, got, at, kind):.4f}")
            n_cold = len(colds)
            print(f"{name[:34]:<34} {kind:<7} {counts['cold']:>2}/{n_cold:<2} {counts['warm']:>3}/{args.trials:<2} "
                  f"{counts['busy']:>3}/{args.trials:<2}  " + "; ".join(notes))
    print("identical: " + ", ".join(f"{s} {ok} of {n}" for s, (ok, n) in totals.items())
          + f"; all {sum(ok for ok, _ in totals.values())} of {sum(n for _, n in totals.values())} trials")


if __name__ == "__main__":
    main()
