"""Fidelity of `pdserve simulate`: its prediction for a trace against a replay of that trace on a real server.

    .venv/bin/python benchmarks/bench_simulator.py [--profile FILE] [--rate 1.2] [--duration 100] [--seed 7]
                                                   [--layout pd] [--keep-logs]

A trace the project has not seen is written in the Azure format (Poisson arrivals at --rate for --duration
seconds, lognormal prompt and output lengths); `pdserve simulate` predicts it on the deployment (PD 1:1, PD 1:2 or
colocated) with the profile (measured first with `pdserve profile` unless --profile names one), then `pdserve up`
serves that deployment on this machine and `pdserve bench --trace` replays the trace against it. Prints TTFT p50,
ITL p50 and output tok/s, predicted and measured, and the error of each; the machine's load average beside them
(another process's load slows the real server, not the simulation).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from servers import REPO, add_server_arguments, default_model_dir, pdserve_server, unwind_on_termination

from pdserve.planning.traces import synthetic, write_azure

LAYOUTS = {"pd": (["--prefill", "1", "--decode", "1"], []), "pd12": (["--prefill", "1", "--decode", "2"], ["--decode", "2"]),
           "colocated": (["--colocated", "1"], [])}


def pdserve(*argv: str, timeout: float = 3600) -> None:
    subprocess.run([sys.executable, "-m", "pdserve", *argv], check=True, timeout=timeout, cwd=REPO)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="a profile of this machine (default: measure one first)")
    ap.add_argument("--rate", type=float, default=1.2)
    ap.add_argument("--duration", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--input-median", type=int, default=256)
    ap.add_argument("--output-median", type=int, default=64)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="pd")
    add_server_arguments(ap)
    args = ap.parse_args()
    unwind_on_termination()
    work = Path(tempfile.mkdtemp(prefix="bench-simulator-"))
    trace = work / "trace.csv"
    write_azure(trace, synthetic(args.rate, args.duration, args.input_median, args.output_median, sigma=0.5,
                                 max_input=1024, max_output=256, seed=args.seed))
    profile = args.profile or str(work / "profile.json")
    if args.profile is None:
        pdserve("profile", "--out", profile, *(["--model-path", args.model_path] if args.model_path else []))
    sim_flags, up_flags = LAYOUTS[args.layout]
    predicted_path = work / "predicted.json"
    pdserve("simulate", "--profile", profile, "--trace", str(trace), *sim_flags, "--json", str(predicted_path))
    predicted = json.loads(predicted_path.read_text())

    model_dir = default_model_dir(args.model_path)
    name = "colocated" if args.layout == "colocated" else "pd"
    server = pdserve_server(name, model_dir, "default", work, [*up_flags, *args.up_args.split()])
    load_before = os.getloadavg()
    try:
        server.start()
        server.wait_ready(args.startup_timeout)
        measured_path = work / "measured.json"
        pdserve("bench", "--base-url", server.base_url, "--trace", str(trace), "--json", str(measured_path))
    finally:
        server.stop()
    measured = json.loads(measured_path.read_text())["results"][0]
    load_after = os.getloadavg()
    rows = [("TTFT p50 (ms)", predicted["ttft_p50_s"] * 1e3, measured["ttft_ms_p50"]),
            ("ITL p50 (ms)", predicted["itl_p50_s"] * 1e3, measured["itl_ms_p50"]),
            ("output tok/s", predicted["output_tok_s"], measured["output_tok_s"])]
    print(f"\n{args.layout}: {predicted['requests']} requests, {args.rate:g}/s for {args.duration:g} s; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} cores)")
    print(f"{'':<15} {'predicted':>10} {'measured':>10} {'error':>7}")
    for label, p, m in rows:
        error = f"{(p - m) / m:+.0%}" if m else "-"
        print(f"{label:<15} {p:>10.1f} {m:>10.1f} {error:>7}")
    print(f"(failed requests: {measured['failed']}; work files in {work})")


if __name__ == "__main__":
    main()
