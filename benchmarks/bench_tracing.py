"""What tracing costs a PD deployment: `pdserve up` at 32 streams with tracing off, on (every request sampled,
exported to a real OTLP receiver in this process) and on with its collector unreachable, in alternating rounds.

    .venv/bin/python benchmarks/bench_tracing.py [--rounds 2] [--concurrency 32] [--num-requests 96]
                                                 [--output-len 128] [--up-args="..."]

Each server is `pdserve up` (bench_serving.py starts and stops it), loaded by `pdserve bench`'s client; the
medians of the rounds are printed beside the targets: on >= 0.97x off, unreachable >= 0.97x off (output tok/s).
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
from pathlib import Path

from bench_serving import measure
from otlp_receiver import serve
from servers import default_model_dir, pdserve_server
from pdserve.benchclient import Load

TARGET = 0.97


def closed_port() -> int:
    """A loopback port nothing listens on: the unreachable collector."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--up-args", default="", help="extra flags for every `pdserve up`")
    args = ap.parse_args()
    server, receiver, endpoint = serve()
    modes = {"off": [], "on": ["--otlp-traces-endpoint", endpoint, "--otlp-traces-sample-ratio", "1"],
             "unreachable": ["--otlp-traces-endpoint", f"127.0.0.1:{closed_port()}"]}
    model_dir = default_model_dir(None)
    load = Load(output_len=args.output_len, prompt_len=args.prompt_len)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-tracing-"))
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        for r in range(args.rounds):
            for mode, flags in modes.items():
                pd = pdserve_server(f"pd-{mode}-{r}", model_dir, model_dir.name, work,
                                    [*flags, *shlex.split(args.up_args)])
                summary = measure(pd, args, model_dir.name, load, [args.concurrency])[0]
                rates[mode].append(summary.output_tok_s)
    finally:
        server.stop(0)
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(rates["off"])
    print(f"\nPD, {args.concurrency} streams, {args.output_len} tokens each, {args.rounds} alternating rounds "
          f"(output tok/s; {len(receiver.spans)} spans received)")
    failed = False
    for mode, values in rates.items():
        median = statistics.median(values)
        verdict = "" if mode == "off" else f"  ratio {median / base:.3f} (target >= {TARGET})"
        failed |= mode != "off" and median / base < TARGET
        print(f"  tracing {mode:12} {median:8.1f}  rounds {', '.join(f'{v:.1f}' for v in values)}{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
