"""What `--enable-deterministic-inference` costs, against the default mode in the same run.

    .venv/bin/python benchmarks/bench_deterministic.py [--batches 1,32] [--rounds 3] [--dtype bfloat16]
                                                       [--quantization w8a8_int8] [--threads 2]

Two engines on the default model, one per mode; each round times a decode step of each (alternating, so a
shared machine's drift falls on both) at every batch size and a 512-token prefill; prints the medians over the
rounds and deterministic/default for each. In-process: the engines' own cost, not the server's.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench_runtime import DTYPES, runtime_decode_step_s, runtime_prefill_s
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path

MODES = {"default": False, "deterministic": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--quantization", default=None, choices=["w8a8_int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(None)
    engines = {name: Engine(RuntimeConfig(
        model_path=str(model_dir), dtype=args.dtype, quantization=args.quantization, deterministic=det,
        cache=CacheConfig(page_size=16, max_total_tokens=65536),
        scheduler=SchedulerConfig(max_running_requests=256, chunked_prefill_size=4096, max_prefill_tokens=16384)))
        for name, det in MODES.items()}
    batches = [int(b) for b in args.batches.split(",")]
    steps: dict[tuple[str, int], list[float]] = {(m, b): [] for m in MODES for b in batches}
    prefill: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for batch in batches:
            for name, engine in engines.items():
                steps[name, batch].append(runtime_decode_step_s(engine, batch, args.new_tokens, 8)[0])
        for name, engine in engines.items():
            prefill[name].append(runtime_prefill_s(engine, 512))
    print(f"model {model_dir.name}, {args.dtype}{', ' + args.quantization if args.quantization else ''}, "
          f"{args.threads} threads; medians of {args.rounds} alternating rounds")
    print(f"{'batch':>5} {'default ms':>10} {'determ. ms':>10} {'ratio':>6}")
    for batch in batches:
        base, det = (statistics.median(steps[m, batch]) for m in MODES)
        print(f"{batch:>5} {base * 1e3:>10.2f} {det * 1e3:>10.2f} {det / base:>6.2f}")
    base, det = (statistics.median(prefill[m]) for m in MODES)
    print(f"prefill 512 tokens: default {base:.3f} s, deterministic {det:.3f} s, ratio {det / base:.2f}")


if __name__ == "__main__":
    main()
