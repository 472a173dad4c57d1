"""What deterministic mode's start-time check (shared/invariance.py) adds to a start, op by op.

    .venv/bin/python benchmarks/bench_deterministic_check.py [--dtype bfloat16] [--lora] [--rounds 3] [--threads 2]

Each round starts a fresh process, as a worker start is: it builds the default model's runner in deterministic
mode and times the check inside it (its first calls pay what a start pays: first-touch memory, the kernels' first
runs) against the whole build (reading and preparing the weights, the pool). Prints medians over the rounds, with
the lowest and highest, of the build, the check, and each op's share of the check: wall-clock time, and the
process's CPU time (all its threads), which a machine shared with other work inflates less.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict

from arms import Spread


def child(dtype: str, lora: bool, threads: int) -> dict:
    import torch

    from pdserve.shared import invariance, model_runner
    from pdserve.shared.config import CacheConfig, LoraConfig, RuntimeConfig
    from pdserve.shared.model_files import resolve_model_path

    torch.set_num_threads(threads)
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # name -> [wall s, CPU s]
    rows, attention, check = invariance._rows, invariance._attention, model_runner.check_batch_invariance

    def timed(name, fn, *args):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        ops[name][0] += time.perf_counter() - wall
        ops[name][1] += time.process_time() - cpu
        return out

    invariance._rows = lambda name, fn: timed(name, rows, name, fn)
    invariance._attention = lambda *args: timed("decode and extend attention", attention, *args)
    model_runner.check_batch_invariance = lambda *args: timed("check", check, *args)
    timed("build", lambda: model_runner.ModelRunner(RuntimeConfig(
        model_path=str(resolve_model_path(None)), dtype=dtype, deterministic=True,
        lora=LoraConfig(max_loras_per_batch=4) if lora else None, cache=CacheConfig(max_total_tokens=16 * 256))))
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lora", action="store_true", help="with LoRA slots (4 slots, rank 16, every module)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.dtype, args.lora, args.threads)))
        return
    runs: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))  # wall ms, CPU ms
    for _ in range(args.rounds):
        cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--threads", str(args.threads)]
        out = subprocess.run(cmd + (["--lora"] if args.lora else []), capture_output=True, text=True, check=True)
        for name, (wall, cpu) in json.loads(out.stdout.splitlines()[-1]).items():
            runs[name][0].append(wall * 1e3)
            runs[name][1].append(cpu * 1e3)
    print(f"default model, {args.dtype}{', LoRA slots' if args.lora else ''}, {args.threads} threads; "
          f"ms, median (lowest-highest) of {args.rounds} fresh processes")
    print(f"{'':<52} {'wall':<22} {'CPU':<22}")
    build, check = runs.pop("build"), runs.pop("check")
    for name, (wall, cpu) in [("runner build (weights, pool, the check)", build), ("the check", check),
                              *sorted(runs.items(), key=lambda kv: -statistics.median(kv[1][0]))]:
        print(f"{name:<52} {Spread.of(wall).text('.0f'):<22} {Spread.of(cpu).text('.0f'):<22}")
    share = statistics.median(check[0]) / statistics.median(build[0])
    print(f"the check is {share:.0%} of the build's wall-clock time")


if __name__ == "__main__":
    main()
