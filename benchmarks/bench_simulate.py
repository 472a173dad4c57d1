"""How long `pdserve simulate` takes at fleet scale: 64 workers serving one hour of an Azure-like trace.

    .venv/bin/python benchmarks/bench_simulate.py [--profile FILE] [--rate 5.4] [--duration 3600]
                                                  [--prefill 24] [--decode 40]

The trace is the Azure 2023 conversation trace's shape (about 19,000 requests an hour, prompts of median ~1,000
tokens, answers of median ~200), Poisson arrivals with lognormal lengths. Without --profile, step costs of a
made-up accelerator fast enough for the rate are used: the simulator's own time is what this measures. Prints
wall and CPU seconds of the simulation alone (the trace built, modules imported, beforehand).
"""
from __future__ import annotations

import argparse
import time

from pdserve.planning.costs import costs_of, load_profile
from pdserve.planning.metrics import report, summarize
from pdserve.planning.simulator import Deployment, simulate
from pdserve.planning.traces import synthetic


def fleet_profile() -> dict:
    """Step costs of the shape a profile has, sized for a GPU-class worker (prefill ~10k tok/s, decode ~15 ms)."""
    return {"version": 1, "page_size": 16, "kv_bytes_per_token": 2 * 32 * 8 * 128 * 2, "max_total_tokens": 400_000,
            "prefill": [{"tokens": n, "cached": c, "seconds": 0.005 + (n - c) * 1e-4 + (n - c) * (c + (n - c) / 2) * 2e-9}
                        for n in (256, 1024, 4096) for c in (0, n // 2)],
            "decode": [{"batch": b, "context": ctx, "seconds": 0.012 + 1e-4 * b + 2e-8 * b * ctx}
                       for b in (1, 16, 64) for ctx in (256, 2048)],
            "transfer": [{"bytes": n, "seconds": 1e-3 + n / 20e9} for n in (1e6, 1e8)],
            "overheads": {"gateway_request_s": 2e-3, "front_request_s": 5e-4, "gateway_token_s": 2e-5}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    ap.add_argument("--rate", type=float, default=5.4)
    ap.add_argument("--duration", type=float, default=3600)
    ap.add_argument("--prefill", type=int, default=24)
    ap.add_argument("--decode", type=int, default=40)
    args = ap.parse_args()
    costs = costs_of(load_profile(args.profile) if args.profile else fleet_profile())
    trace = synthetic(args.rate, args.duration, input_median=1000, output_median=200, sigma=0.8,
                      max_input=8000, max_output=2000, seed=0)
    deployment = Deployment(prefill=args.prefill, decode=args.decode, max_running_requests=256)
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(deployment, costs, trace)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(report(summarize(result, 1.0, 0.05)))
    print(f"{len(trace)} requests over {args.duration:.0f} s, {args.prefill + args.decode} workers: simulated in "
          f"{wall:.1f} s wall, {cpu:.1f} s CPU")


if __name__ == "__main__":
    main()
