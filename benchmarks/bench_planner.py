"""Goodput of the SLO planner against static splits, on a load that changes side twice.

    .venv/bin/python benchmarks/bench_planner.py [--workers 16 64] [--phase-s 120] [--real] [--real-phase-s 30]

The workload (pdserve.planning.traces.two_phase): long prompts with short answers, then short prompts with long
answers, then long prompts again, one phase each. Goodput: requests within both SLOs (TTFT, and mean ITL after
the first token) per second of the run.

- Simulated (`pdserve simulate`'s simulator, fleet-scale step costs of bench_simulate.py unless --profile names a
  profile): at each --workers W, the rates scaled with W, every static PD split of the W workers (W <= 16; above
  that `pdserve plan`'s search: evenly spaced splits, then every one around the best) and the planner starting
  from the best of them (deciding every 2 s on the last 8 s, as the phases are short to keep the run short).
- Real (--real): three workers of the default model on this machine through `pdserve up` (PD 1:2, PD 2:1 and the
  planner from the better of those two), the same trace shape replayed by the bench client at its arrival times,
  the deployments one after the other. The machine's load average is printed beside the figures: other
  processes slow the real servers, not the simulation.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_simulate import fleet_profile

from pdserve.planning.costs import costs_of, load_profile
from pdserve.planning.metrics import summarize
from pdserve.planning.plan import plan
from pdserve.planning.simulator import Deployment, simulate
from pdserve.planning.traces import two_phase
from pdserve.services.gateway.planner import PlannerSettings

# Per worker, at fleet costs: a prefill worker computes ~9 prompts of 1,024 tokens a second, a decode worker holds
# 64 answers of 256 tokens (~13 a second): each phase wants about 3/4 of the workers on its side.
FLEET = dict(rates_per_worker=(6.5, 9.5), long=1024, short=32, answer=8, story=256, slo=(1.0, 0.025))
# Three CPU workers of the default model, one thread each, on two shared cores.
REAL = dict(rates=(0.6, 1.5), long=768, short=32, answer=4, story=128, slo=(2.5, 0.1))


def simulated(workers: int, phase_s: float, costs) -> dict:
    f = FLEET
    rates = tuple(r * workers for r in f["rates_per_worker"])
    trace = two_phase(rates, phase_s, f["long"], f["short"], f["answer"], f["story"], seed=workers)
    slo = f["slo"]
    started = time.perf_counter()
    if workers <= 16:
        static = [summarize(simulate(Deployment(prefill=p, decode=workers - p), costs, trace), *slo)
                  for p in range(1, workers)]
    else:
        static = [s for s in plan(costs, trace, workers, {}, *slo)["all"] if not s["deployment"].startswith("colo")]
    best = max(static, key=lambda s: s["goodput_rps"])
    p, d = (int(x) for x in best["deployment"].split()[1].split(":"))
    settings = PlannerSettings(*slo, interval_s=2, window_s=8, dwell_s=30, itl_knee_batch=120)
    planned = summarize(simulate(Deployment(prefill=p, decode=d, planner=settings), costs, trace), *slo)
    return {"workers": workers, "requests": len(trace), "rates": rates, "phase_s": phase_s, "slo": slo,
            "static": {s["deployment"]: s["goodput_rps"] for s in static}, "best_static": best["deployment"],
            "best_static_goodput": best["goodput_rps"], "planner_goodput": planned["goodput_rps"],
            "planner_completed": planned["completed"], "switches": planned["switches"],
            "wall_s": time.perf_counter() - started}


def real(phase_s: float, work: Path, only: tuple[str, ...] = ("PD 1:2", "PD 2:1"), start: str = "PD 1:2") -> dict:
    """`only`: the static splits to run; the planner starts from the better of them (`start` without any)."""
    from servers import default_model_dir, unwind_on_termination

    from pdserve.benchclient.load import Load, Target
    from pdserve.benchclient.replay import replay

    unwind_on_termination()
    r = REAL
    trace = two_phase(r["rates"], phase_s, r["long"], r["short"], r["answer"], r["story"], seed=3)
    ttft_slo, itl_slo = r["slo"]
    planner = ["--planner", "slo", "--ttft-slo-ms", str(ttft_slo * 1e3), "--itl-slo-ms", str(itl_slo * 1e3),
               "--planner-interval-s", "2", "--planner-window-s", "10", "--planner-dwell-s", "20"]
    model_dir = default_model_dir(None)
    runs = [("PD 1:2", ["--prefill", "1", "--decode", "2"]), ("PD 2:1", ["--prefill", "2", "--decode", "1"])]
    figures: dict[str, dict] = {}
    for label, flags in [r for r in runs if r[0] in only] + [("planner", None)]:
        if flags is None:  # the planner starts from the better static split
            better = max(figures, key=lambda k: figures[k]["goodput_rps"]) if figures else start
            flags, label = dict(runs)[better] + planner, f"{better} + planner"
        load_before = os.getloadavg()[0]
        server = started("pd", model_dir, work / label.replace(" ", "_").replace(":", "-"), ["--threads", "1", *flags])
        try:
            target = Target(base_url=server.base_url, model="default", api_key=None)
            results = []
            summary = asyncio.run(replay(target, Load(), trace, lambda e: None, on_done=results.append))
            switches = planner_switches(server.base_url) if "planner" in label else []
        finally:
            server.stop()
        good = [x for x in results if x.ok and x.ttft_s <= ttft_slo and (x.tpot_s or 0.0) <= itl_slo]
        figures[label] = {"goodput_rps": len(good) / summary.duration_s, "requests": len(results),
                          "failed": sum(not x.ok for x in results), "within_slo": len(good) / max(1, len(results)),
                          "switches": switches, "load_average": (load_before, os.getloadavg()[0])}
        print(f"  {label}: {figures[label]}", flush=True)
    return {"requests": len(trace), "rates": r["rates"], "phase_s": phase_s, "slo": r["slo"], "runs": figures}


def started(name: str, model_dir: Path, work: Path, flags: list[str], tries: int = 3):
    """A ready server; its ports are drawn again when one was taken meanwhile (the draw checks two workers' ports,
    and these deployments have three)."""
    from servers import pdserve_server

    for attempt in range(tries):
        server = pdserve_server(name, model_dir, "default", work / str(attempt), flags)
        try:
            server.start()
            server.wait_ready(600)
            return server
        except RuntimeError:
            server.stop()
            if attempt == tries - 1:
                raise


def planner_switches(base_url: str) -> list[dict]:
    import urllib.request

    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/status.json", timeout=10) as reply:
        decisions = json.load(reply)["planner"]["decisions"]
    return [d for d in decisions if d["action"] == "switch"][::-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--phase-s", type=float, default=120.0, help="each phase of the simulated trace")
    ap.add_argument("--profile", default=None, help="step costs (default: bench_simulate.py's fleet-scale ones)")
    ap.add_argument("--real", action="store_true", help="also three real workers of the default model here")
    ap.add_argument("--real-phase-s", type=float, default=30.0)
    ap.add_argument("--real-static", nargs="*", default=["PD 1:2", "PD 2:1"],
                    help="the static splits run for real (none: only the planner, from --real-start)")
    ap.add_argument("--real-start", default="PD 1:2", choices=["PD 1:2", "PD 2:1"])
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    costs = costs_of(load_profile(args.profile) if args.profile else fleet_profile())
    out: dict = {"simulated": []}
    for workers in args.workers:
        row = simulated(workers, args.phase_s, costs)
        out["simulated"].append(row)
        moves = ", ".join(f"{s['at_s']:.0f}s {s['from']}->{s['to']}" for s in row["switches"][:12])
        print(f"simulated, {workers} workers, {row['requests']} requests: best static {row['best_static']} "
              f"{row['best_static_goodput']:.2f} good req/s; planner {row['planner_goodput']:.2f} "
              f"({row['planner_goodput'] / max(row['best_static_goodput'], 1e-9):.2f}x), "
              f"{len(row['switches'])} switches [{moves}]; {row['wall_s']:.0f} s to simulate", flush=True)
    if args.real:
        work = Path(tempfile.mkdtemp(prefix="bench-planner-"))
        print(f"real, three workers (load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores):", flush=True)
        out["real"] = real(args.real_phase_s, work, tuple(args.real_static), args.real_start)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
