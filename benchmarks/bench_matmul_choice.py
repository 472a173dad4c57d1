"""The table behind the CPU's matmul kernel choice (shared/matmul_choice.py, `fixed_order_pays` and
`fixed_order_head_pays` in shared/linear.py): the fixed-order kernel against oneDNN on the default model's shapes
from 1 to 1,024 rows, and the whole decode step with each.

    .venv/bin/python benchmarks/bench_matmul_choice.py [--rounds 3] [--threads 1] [--reps 15]
                                                       [--rows 1,2,4,...,1024] [--batches 1,8,32,64]

Layers: qkv, o, gate_up and down in bf16, and the whole LM head (49,152 x 576, fp32 output), through the same
function as the start-up probe (`linear.probe`): oneDNN's side is what a layer of the default mode runs (the
native GEMV at 1-4 rows; for the LM head an fp32 copy of the weight, torch having no bf16 x bf16 -> fp32 matmul
on the CPU), the two kernels called alternately, the median of --reps calls (fewer past 64 rows). Each round
times them in a process of its own; the table gives the median over rounds of fixed / oneDNN (below 1: the
fixed-order kernel is faster) and the medians of each kernel's microseconds.

Decode step: an engine (the default model, bf16) with PDSERVE_CPU_MATMUL=fixed, one with =onednn, each round
in a process of its own with the same --threads, their order rotating from round to round (benchmarks/arms.py);
the median step over 30 steps of --batches sequences, then median (lowest-highest) over rounds and the ratio.

Last, what this machine's start-up probe decided, from the file it cached.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from arms import Ratio, Spread, order

HEAD = ("lm_head", (49152, 576), True)


def layers_child(threads: int, reps: int, rows: list[int]) -> list[dict]:
    from dataclasses import asdict

    from pdserve.shared import linear
    from pdserve.shared.matmul_choice import PROBE_SHAPES

    shapes = [s for s in PROBE_SHAPES if not s[2]] + [HEAD]
    out = []
    for r in rows:
        out += [asdict(t) for t in linear.probe(max(3, reps * 64 // max(r, 64)), (r,), shapes, threads)]
    return out


def decode_child(threads: int, batches: list[int], steps: int = 30) -> dict[str, float]:
    import torch

    from bench_int8 import decode_step_ms  # the same decode-step timing as the int8 benchmark
    from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
    from pdserve.shared.engine import Engine
    from pdserve.shared.model_files import resolve_model_path

    torch.set_num_threads(threads)
    engine = Engine(RuntimeConfig(model_path=str(resolve_model_path(None)), dtype="bfloat16",
                                  cache=CacheConfig(page_size=16, max_total_tokens=16384),
                                  scheduler=SchedulerConfig(max_running_requests=max(batches))))
    return {str(batch): decode_step_ms(engine, batch, steps + 2) for batch in batches}


def child(*args: str, env: dict | None = None):
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"child {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="1: as the start-up probe, and as `pdserve up` runs "
                                                              "each worker")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--child", choices=["layers", "decode"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.child == "layers":
        print(json.dumps(layers_child(args.threads, args.reps, rows)))
        return
    if args.child == "decode":
        print(json.dumps(decode_child(args.threads, batches)))
        return

    common = ["--threads", str(args.threads), "--reps", str(args.reps), "--rows", args.rows,
              "--batches", args.batches]
    layer_rounds, steps = [], {"fixed": [], "onednn": []}
    for i in range(args.rounds):
        layer_rounds.append(child("--child", "layers", *common))
        for arm in order(["fixed", "onednn"], i):
            steps[arm].append(child("--child", "decode", *common, env={"PDSERVE_CPU_MATMUL": arm}))

    print(f"fixed-order kernel / oneDNN, {args.threads} thread(s), median of {args.rounds} rounds "
          "(below 1: fixed-order faster); in brackets fixed / oneDNN microseconds")
    shapes = list(dict.fromkeys(t["shape"] for t in layer_rounds[0]))
    print(f"| shape | {' | '.join(f'{r} rows' if r > 1 else '1 row' for r in rows)} |")
    print("|---|" + "---:|" * len(rows))
    for shape in shapes:
        cells = []
        for r in rows:
            picked = [[t for t in rnd if t["shape"] == shape and t["rows"] == r][0] for rnd in layer_rounds]
            ratio = statistics.median(t["fixed_us"] / t["onednn_us"] for t in picked)
            fixed = statistics.median(t["fixed_us"] for t in picked)
            onednn = statistics.median(t["onednn_us"] for t in picked)
            cells.append(f"{ratio:.2f} ({fixed:.0f} / {onednn:.0f})")
        print(f"| {shape} | {' | '.join(cells)} |")

    print(f"\ndecode step, ms, {args.threads} thread(s), median (lowest-highest) of {args.rounds} rounds, "
          "arms alternating")
    print("| batch | fixed-order | oneDNN | fixed / oneDNN |")
    print("|---:|---:|---:|---:|")
    for b in batches:
        fixed = [s[str(b)] for s in steps["fixed"]]
        onednn = [s[str(b)] for s in steps["onednn"]]
        print(f"| {b} | {Spread.of(fixed).text()} | {Spread.of(onednn).text()} | {Ratio.of(fixed, onednn).text()} |")

    from pdserve.shared import linear
    from pdserve.shared.matmul_choice import TOLERANCE

    os.environ.pop("PDSERVE_CPU_MATMUL", None)
    choice = linear._choice_here()
    if not choice.timings:
        print(f"\nthis machine's start-up choice: {choice.source}")
        return
    kernel = {True: "the fixed-order kernel", False: "oneDNN"}
    print(f"\nthis machine's start-up choice ({choice.source}): bf16 layers on {kernel[choice.layers]} (probe "
          f"ratio {choice.ratio(False):.3f}), fp32-output layers on {kernel[choice.head]} (probe ratio "
          f"{choice.ratio(True):.3f}); the fixed-order kernel is taken up to a ratio of {TOLERANCE}")

if __name__ == "__main__":
    main()
