"""What tracing costs a PD deployment: `pdserve up` at 32 streams with tracing off, on (every request sampled,
exported to a real OTLP receiver in this process) and on with its collector unreachable.

    .venv/bin/python benchmarks/bench_tracing.py [--rounds 6] [--concurrency 32] [--num-requests 96]
                                                 [--output-len 128] [--up-args="..."]

Each round runs the three modes once, in an order that rotates from round to round (benchmarks/arms.py: off, on,
unreachable; then on, unreachable, off; ...), each a `pdserve up` of its own (bench_serving.py starts and stops
it) with the same flags but tracing's, loaded by `pdserve bench`'s client. Prints each mode's median output tok/s
and spread over the rounds, and each traced mode against off: the quotient of the medians (beside the targets:
on >= 0.97x off, unreachable >= 0.97x off) and the range of the per-round quotients.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from arms import Ratio, Spread, order
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
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--up-args", default="", help="extra flags for every `pdserve up`")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds takes a positive number")
    server, receiver, endpoint = serve()
    modes = {"off": [], "on": ["--otlp-traces-endpoint", endpoint, "--otlp-traces-sample-ratio", "1"],
             "unreachable": ["--otlp-traces-endpoint", f"127.0.0.1:{closed_port()}"]}
    model_dir = default_model_dir(None)
    load = Load(output_len=args.output_len, prompt_len=args.prompt_len)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-tracing-"))
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            for mode in order(list(modes), r):
                pd = pdserve_server(f"pd-{mode}-{r}", model_dir, model_dir.name, work,
                                    [*modes[mode], *shlex.split(args.up_args)])
                summary = measure(pd, args, model_dir.name, load, [args.concurrency])[0]
                rates[mode].append(summary.output_tok_s)
                print(f"round {r + 1} tracing {mode}: {summary.output_tok_s:.1f} output tok/s", flush=True)
    finally:
        server.stop(0)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nPD, {args.concurrency} streams, {args.output_len} tokens each, {args.rounds} rounds in rotating order, "
          f"{time.monotonic() - started:.0f} s (output tok/s, median (lowest-highest); {len(receiver.spans)} spans "
          f"received)")
    failed = False
    for mode, values in rates.items():
        verdict = ""
        if mode != "off":
            ratio = Ratio.of(values, rates["off"])
            verdict = f"  vs off {ratio.text()} (target >= {TARGET})"
            failed |= ratio.of_medians < TARGET
        print(f"  tracing {mode:12} {Spread.of(values).text('.1f'):>24}{verdict}")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
