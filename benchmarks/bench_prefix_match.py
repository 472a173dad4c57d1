"""What matching a prefix to the token costs: the radix cache's match with `max_tokens` (whole pages, then the
page the prompt leaves part-way) against the whole-page match alone, on trees of 1 to 10,000 cached prompts, and
the one page copy a request that shares part of a page makes before its first step. Decode steps match nothing:
both costs are paid once per admitted prompt, never per step.

    .venv/bin/python benchmarks/bench_prefix_match.py [--page-size 16] [--rounds 5]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from pdserve.shared.kv_pool import KVLayout, KVPool
from pdserve.shared.radix_cache import RadixCache


def best_of(rounds: int, n: int, fn) -> float:
    """Microseconds per call, best of `rounds` runs of `n` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    s, rng = args.page_size, random.Random(0)
    print(f"page size {s}; microseconds per match, best of {args.rounds}")
    print(f"{'cached prompts':>15} {'whole pages':>12} {'to the token':>13} {'extra':>8}   "
          f"(a repeated 37-token prompt | a new one, which every root child is tried against)")
    for prompts in (1, 100, 1000, 10000):
        cache = RadixCache(s)
        seqs = [[rng.randrange(50000) for _ in range(64)] for _ in range(prompts)]
        # Prompts that share a system prompt's first page, as chat traffic does: many children under one node.
        for i, seq in enumerate(seqs):
            seq[:s] = seqs[0][:s] if i % 2 else seq[:s]
            cache.insert(seq, list(range(i * 4, i * 4 + 4)))
        prompt = seqs[-1][:37]
        whole = best_of(args.rounds, 2000, lambda: cache.match_prefix(prompt))
        exact = best_of(args.rounds, 2000, lambda: cache.match_prefix(prompt, max_tokens=len(prompt) - 1))
        match = cache.match_prefix(prompt, max_tokens=len(prompt) - 1)
        assert len(match.pages) * s + match.tail_tokens == len(prompt) - 1
        new = [50001 + i for i in range(37)]
        whole_new = best_of(args.rounds, 2000, lambda: cache.match_prefix(new))
        exact_new = best_of(args.rounds, 200, lambda: cache.match_prefix(new, max_tokens=len(new) - 1))
        print(f"{prompts:>15} {whole:>12.1f} {exact:>13.1f} {exact - whole:>8.1f}   | "
              f"{whole_new:>8.1f} {exact_new:>9.1f} {exact_new - whole_new:>8.1f}")
    # The children's sorted index has a price where pages come and go: 10,000 first pages that all start with
    # one token (a BOS, or a chat template's first), inserted and then evicted.
    for _ in range(2):
        cache, t0 = RadixCache(s), time.perf_counter()
        for i in range(10000):
            cache.insert([1] + [rng.randrange(50000) for _ in range(s - 1)], [i])
        t1 = time.perf_counter()
        probe = cache.match_prefix([1, 2, 3] + [7] * 34, max_tokens=36)
        t2 = time.perf_counter()
        cache.evict(10000)
        t3 = time.perf_counter()
        print(f"10,000 first pages sharing their first token: insert {(t1 - t0) * 100:.1f} us a page, a new "
              f"prompt's match {(t2 - t1) * 1e6:.0f} us, evict {(t3 - t2) * 100:.1f} us a page"
              + ("" if probe.tail is not None else " (no partial page)"))
    # The default model's page: 30 layers x K/V x 16 tokens x 3 heads x 64 dims in bf16.
    pool = KVPool(KVLayout(64, s, 30, 3, 64, torch.bfloat16))
    copy = best_of(args.rounds, 2000, lambda: pool.copy_page(1, 2))
    print(f"one page copy ({pool.layout.page_bytes / 1024:.0f} KiB, the default model): {copy:.1f} us, "
          f"once per request that shares part of a page")


if __name__ == "__main__":
    main()
