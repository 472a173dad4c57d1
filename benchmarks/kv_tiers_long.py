"""bench_kv_tiers.py's `long` case: a prompt longer than a quarter of the pool (the storage writer takes at most a
quarter of the pool at once, so such a prompt is written in parts), pushed out of the pool by five others as long,
then asked again, on a colocated server with the storage tier and a small pool (--long-pool: 4,096 tokens).

Each rep asks, one at a time: the long prompt (cold), five others of its length (cold), the long prompt again (its
prefix read back from storage). Targets: cached tokens >= 1,000 on every read-back; TTFT p50 of the read-backs
against the p50 of the cold prompts asked in the same run <= 0.35; the same greedy text as computed cold.
"""
from __future__ import annotations

from kv_tiers_load import Answer, Check, ask_all, ratio_check, same_answers, text, ttft_ms_p50

PUSHERS = 5


def long_case(ctx, serving, warm) -> list[Check]:
    """`ctx`, `serving`, `warm`: bench_kv_tiers.py's."""
    args = ctx.args
    store = ctx.storage("long")
    server = ctx.server("long-tiers", "colocated", ["--max-total-tokens", str(args.long_pool),
                                                    *ctx.tier_flags(store)])
    cold: list[Answer] = []
    first: list[Answer] = []
    again: list[Answer] = []
    with serving(server, timeout_s=args.startup_timeout):
        warm(ctx, server, args.long_len)
        for rep in range(args.reps):
            prompt = text("long", rep, args.long_len)
            pushers = [text("long-push", rep * PUSHERS + i, args.long_len) for i in range(PUSHERS)]
            answers = ask_all(ctx.target(server), [prompt, *pushers, prompt])
            first.append(answers[0])
            cold += answers[:-1]
            again.append(answers[-1])
            print(f"[tiers] long rep {rep + 1}: prompt {answers[0].prompt_tokens} tokens; TTFT cold "
                  f"{', '.join(f'{x.ttft_s * 1e3:.0f}' if x.ok else x.error or 'failed' for x in answers[:-1])} "
                  f"ms; read back {answers[-1].ttft_s * 1e3 if answers[-1].ok else float('nan'):.0f} ms, cached "
                  f"tokens {answers[-1].cached_tokens}", flush=True)
    cached = [x.cached_tokens or 0 for x in again]
    return [Check("long", "prompt tokens / the pool", "> 0.25",
                  f"{first[0].prompt_tokens / args.long_pool:.2f} ({first[0].prompt_tokens} / {args.long_pool})",
                  first[0].prompt_tokens > args.long_pool / 4),
            Check("long", "cached tokens read back, fewest", ">= 1000", f"{min(cached)} (of {cached})",
                  min(cached) >= 1000),
            ratio_check("long", "TTFT p50 read back / cold", ttft_ms_p50(again), ttft_ms_p50(cold), 0.35, False,
                        "ms"),
            same_answers("long", "greedy answers, read back = computed", again, first)]
