"""The GPU targets (the runtime's, issue 27; serving at the engine's speed, issue 39) beside the figures of one
`benchmarks/gpu_check.sh` run.

    python benchmarks/gpu_report.py [--runtime R.json] [--colocated C.json] [--pd P.json]
                                    [--kv-metrics METRICS.txt] [--failed STEP] [--json OUT.json]

R.json is what `gpu_runtime.py --json` wrote; C.json and P.json are `pdserve bench --json` files (one or
several levels each; several files of one deployment are merged with `--colocated A --colocated B`); the
metrics file is the prefill worker's /metrics text after the PD run (its KV transfer counters). Prints
one line per target: what it asks, the figure, met / missed (or "not measured" where this run has no
figure for it), and writes the whole lot as JSON. Plain Python: it runs anywhere, GPU or not.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Target:
    what: str
    figure: str
    met: bool | None  # None: this run has no figure for it


def _fmt(x: float | None, unit: str = "", digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def decode_targets(rt: dict) -> list[Target]:
    """Targets on the runtime alone, from gpu_runtime.py's result (keys are batch sizes as strings)."""
    on = rt.get("decode_ms", {}).get("on", {})
    hf = rt.get("transformers_compiled_ms", {})
    busy = rt.get("profile", {}).get("on", {}).get("64", {}).get("gpu_busy_fraction")
    b1, b64, hf64 = on.get("1"), on.get("64"), hf.get("64")
    speedup = hf64 / b64 if b64 and hf64 else None
    rows = [
        Target("decode step, batch 1 <= 1.0 ms (graphs on)", _fmt(b1, " ms"), None if b1 is None else b1 <= 1.0),
        Target("decode step, batch 64 <= 1.5 ms (graphs on)", _fmt(b64, " ms"),
               None if b64 is None else b64 <= 1.5),
        Target("batch 64 >= 2.5x faster than transformers (static cache + torch.compile)",
               f"{_fmt(speedup, 'x')} ({_fmt(hf64, ' ms')} per token there)",
               None if speedup is None else speedup >= 2.5),
        Target("GPU busy >= 75% of a batch-64 step (graphs on)", _fmt(None if busy is None else 100 * busy, " %", 1),
               None if busy is None else busy >= 0.75),
    ]
    for key, what in (("greedy_bf16_graphs", "greedy bf16 identical with graphs on and off"),
                      ("greedy_fp32_transformers", "greedy fp32 identical to transformers")):
        g = rt.get(key)
        rows.append(Target(what, "n/a" if g is None else f"{g['identical']}/{g['of']} prompts",
                           None if g is None else g["identical"] == g["of"]))
    return rows


def levels(paths: list[str]) -> dict[int, dict]:
    """Every level of some `pdserve bench --json` files, by concurrency."""
    out: dict[int, dict] = {}
    for path in paths:
        with open(path) as f:
            for level in json.load(f)["results"]:
                out[level["concurrency"]] = level
    return out


def kv_transfer_gbs(metrics_text: str) -> float | None:
    """GB/s of the prefill worker's KV writes: bytes over the seconds its writes took, every peer summed."""
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics_text, re.M))
    seconds = total("pdserve_worker_kv_transfer_seconds_sum")
    return total("pdserve_worker_kv_transfer_bytes_total") / seconds / 1e9 if seconds > 0 else None


def serving_targets(colo: dict[int, dict], pd: dict[int, dict], kv_gbs: float | None, raw_gbs: float | None,
                    rt: dict) -> list[Target]:
    """Issue 39's: the server delivers what its engine computes (the engine's own rate and step from `rt`)."""
    def tok_s(lv: dict[int, dict], c: int) -> float | None:
        level = lv.get(c)
        return level["output_tok_s"] if level and level["completed"] else None

    on = rt.get("decode_ms", {}).get("on", {})
    step1, step64 = on.get("1"), on.get("64")
    engine64 = 64 / step64 * 1000 if step64 else None  # tokens per second the engine computes at batch 64
    itl = colo.get(1, {}).get("itl_ms_p50")
    c64, c256, p64 = tok_s(colo, 64), tok_s(colo, 256), tok_s(pd, 64)
    of_engine = c64 / engine64 if c64 and engine64 else None
    itl_ratio = itl / step1 if itl and step1 else None
    pd_ratio = p64 / c64 if p64 and c64 else None
    return [
        Target("colocated, 1 stream ITL p50 <= 1.2x the batch-1 step",
               f"{_fmt(itl_ratio, 'x')} ({_fmt(itl, ' ms')} against {_fmt(step1, ' ms')})",
               None if itl_ratio is None else itl_ratio <= 1.2),
        Target("colocated, 64 streams >= 25,000 tok/s", _fmt(c64, " tok/s", 0), None if c64 is None else c64 >= 25000),
        Target("colocated, 64 streams >= 0.6x the engine's rate at batch 64",
               f"{_fmt(of_engine, 'x')} (engine {_fmt(engine64, ' tok/s', 0)})",
               None if of_engine is None else of_engine >= 0.6),
        Target("colocated, 256 streams >= 35,000 tok/s", _fmt(c256, " tok/s", 0),
               None if c256 is None else c256 >= 35000),
        Target("PD on one GPU, 64 streams >= 0.9x colocated", _fmt(pd_ratio, "x"),
               None if pd_ratio is None else pd_ratio >= 0.9),
        # Whether the bytes went through host memory is not visible from here: the figure is for reading.
        Target("PD KV transfer GB/s against a raw device-to-device copy",
               f"{_fmt(kv_gbs, ' GB/s')} against {_fmt(raw_gbs, ' GB/s')}", None),
    ]


def tp_targets(tp: dict) -> list[Target]:
    """gpu_tp.py's figures: greedy TP 1 vs TP 2 identical (a target), decode step times (reported)."""
    if not tp:
        return []
    steps = tp.get("step_ms", {})
    one, many = steps.get("tp1", {}), steps.get(f"tp{tp['tp_size']}", {})
    times = ", ".join(f"batch {b}: {one[b]:.3f} / {many.get(b, float('nan')):.3f} ms" for b in one)
    return [Target(f"TP {tp['tp_size']} greedy fp32 identical to TP 1", str(tp.get("greedy_identical")),
                   tp.get("greedy_identical")),
            Target(f"decode step TP 1 / TP {tp['tp_size']}", times or "-", None)]


def tier_targets(tiers: dict) -> list[Target]:
    """gpu_tiers.py's figures: greedy identical with the prefix from host memory, restore GB/s (targets)."""
    if not tiers:
        return []
    restore = tiers.get("restore_scattered_gbs")
    return [Target("host tier: greedy identical, prefix from host memory",
                   f"{tiers.get('greedy_identical')} ({tiers.get('host_hit_tokens')} tokens from host)",
                   bool(tiers.get("greedy_identical") and tiers.get("prefix_from_host"))),
            Target("host tier restore >= 10 GB/s per worker (scattered pages)",
                   f"{_fmt(restore, ' GB/s')} (consecutive {_fmt(tiers.get('restore_consecutive_gbs'), ' GB/s')}, "
                   f"store {_fmt(tiers.get('store_scattered_gbs'), ' GB/s')})",
                   None if restore is None else restore >= 10)]


def format_targets(rows: list[Target]) -> str:
    width = max(len(r.what) for r in rows)
    verdict = {True: "met", False: "MISSED", None: "-"}  # "-": no figure, or one that is only reported
    return "\n".join(f"  {r.what:<{width}}  {r.figure:<36} {verdict[r.met]}" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runtime", default=None, help="gpu_runtime.py --json output (missing: its targets unmeasured)")
    ap.add_argument("--colocated", action="append", default=[], help="pdserve bench --json of colocated")
    ap.add_argument("--pd", action="append", default=[], help="pdserve bench --json of prefill + decode")
    ap.add_argument("--kv-metrics", default=None, help="the prefill worker's /metrics text after the PD run")
    ap.add_argument("--gpu", default=None, help="the device, as nvidia-smi names it")
    ap.add_argument("--worker-alone", default=None, help="bench_worker_streams.py --json of the colocated worker")
    ap.add_argument("--tp", default=None, help="gpu_tp.py --json output, where the machine had 2 GPUs or more")
    ap.add_argument("--tiers", default=None, help="gpu_tiers.py --json output")
    ap.add_argument("--failed", action="append", default=[], help="a step of the check that failed (repeatable)")
    ap.add_argument("--elapsed", type=float, default=None, help="seconds the whole check took")
    ap.add_argument("--json", default=None, help="write runtime, serving and targets here")
    args = ap.parse_args()
    rt: dict = {}
    if args.runtime and os.path.exists(args.runtime):
        with open(args.runtime) as f:
            rt = json.load(f)
    device = args.gpu or rt.get("device", "?")
    colo, pd = levels(args.colocated), levels(args.pd)
    kv_gbs = None
    if args.kv_metrics:
        with open(args.kv_metrics) as f:
            kv_gbs = kv_transfer_gbs(f.read())
    tp: dict = {}
    if args.tp and os.path.exists(args.tp):
        with open(args.tp) as f:
            tp = json.load(f)
    tiers: dict = {}
    if args.tiers and os.path.exists(args.tiers):
        with open(args.tiers) as f:
            tiers = json.load(f)
    rows = (decode_targets(rt) + serving_targets(colo, pd, kv_gbs, rt.get("raw_d2d_copy_gbs"), rt) + tp_targets(tp)
            + tier_targets(tiers))
    print(f"GPU targets on {device}:")
    print(format_targets(rows))
    for name, lv in (("colocated", colo), ("PD", pd)):
        for c, level in sorted(lv.items()):
            print(f"  {name:>9} {c:>4} streams: {level['output_tok_s']:>9,.0f} tok/s, TTFT p50 "
                  f"{_fmt(level['ttft_ms_p50'], ' ms', 1)}, ITL p50 {_fmt(level['itl_ms_p50'], ' ms', 2)}, "
                  f"{level['completed']} ok, {level['failed']} failed")
    alone = []
    if args.worker_alone and os.path.exists(args.worker_alone):
        with open(args.worker_alone) as f:
            alone = json.load(f)["results"]
    for r in alone:
        print(f"  worker alone {r['streams']:>4} streams: {r['tok_s']:>9,.0f} tok/s, ITL p50 "
              f"{_fmt(r['itl_ms_p50'], ' ms', 2)} (steady {_fmt(r['steady_tok_s'], ' tok/s', 0)})")
    if args.failed:
        print(f"  steps that failed: {', '.join(args.failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "elapsed_s": args.elapsed, "failed_steps": args.failed, "runtime": rt,
                       "serving": {"colocated": colo, "pd": pd, "kv_transfer_gbs": kv_gbs,
                                   "worker_alone": alone}, "tensor_parallel": tp, "kv_tiers": tiers,
                       "targets": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
