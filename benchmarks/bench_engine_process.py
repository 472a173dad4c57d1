"""What serving costs above the engine's own step, before and after the engine got a process of its own.

    .venv/bin/python benchmarks/bench_engine_process.py [--before REV] [--after REV] [--rounds 5] [--tokens 128]
                                                        [--streams 32] [--threads N] [--quantization w8a8_int8]

Lays out the project at REV (default: the last commit whose workers ran the engine in their own process,
1f637ac) beside this checkout (or beside `--after REV`, laid out the same way: a commit, where the working tree
may change while the benchmark runs), then runs `--rounds` rounds of three arms, each in a process of its own with the
same `--threads` compute threads (default: every core this process may use) and one inter-op thread, in an order
that rotates from round to round (benchmarks/arms.py: no arm always first):
- before / after: a colocated worker of the default model from REV / from this checkout or --after, measured by a gRPC
  client on loopback (the worker's Generate stream; no gateway in between, so what is measured is the worker):
  the inter-token gap p50 of one stream, and the output tokens per second of `--streams` concurrent streams;
- in-process: the engine's own step: the gap between one request's outputs with the engine stepping in a
  process of its own (no gRPC, no channel).
Prints each round, then each figure's median and spread over the rounds, after/before as the quotient of the
medians and the range of the per-round quotients, and the issue's two CPU targets beside them:
- 1-stream ITL p50 <= the in-process step + 0.5 ms (this checkout; medians);
- 32-stream throughput >= 1.0x before (quotient of the medians).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from procs import Proc, free_port  # noqa: E402

from arms import Ratio, Spread, order  # noqa: E402
from bench_worker_streams import level, stream  # noqa: E402 (a sibling script: streams straight to a worker)
from servers import layout  # noqa: E402
from pdserve.proto import worker_pb2 as pb  # noqa: E402
from pdserve.proto import worker_pb2_grpc as pb_grpc  # noqa: E402


def start(label: str, pythonpath: str | None, extra: list[str]) -> tuple[Proc, str]:
    port = free_port()
    env = {"PYTHONPATH": pythonpath} if pythonpath else {}
    proc = Proc(f"{label}:{port}", ["colocated", "--port", str(port), "--http-port", str(free_port()),
                                    "--max-running-requests", "64", "--log-stats-interval", "0", *extra],
                health_url=None).start(env)
    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(addr) as ch:
                if pb_grpc.WorkerStub(ch).Health(pb.Empty(), timeout=1).ok:
                    return proc, addr
        except grpc.RpcError:
            pass
        if not proc.alive():
            raise RuntimeError(f"{label} exited:\n{proc.tail()}")
        time.sleep(0.5)
    raise RuntimeError(f"{label} not ready:\n{proc.tail()}")


def measure(addr: str, tokens: int, streams: int, tag: str) -> tuple[float, float]:
    """(1-stream ITL p50 in ms, `streams`-stream output tok/s)."""
    with grpc.insecure_channel(addr) as ch:
        stub = pb_grpc.WorkerStub(ch)
        stream(stub, f"{tag}-warm", 16)
        times = stream(stub, f"{tag}-one", tokens)
    itl = statistics.median(b - a for a, b in zip(times[1:], times[2:])) * 1000  # after the first token
    return itl, level(addr, streams, tokens, tag)["tok_s"]


IN_PROCESS = """
import statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))  # as the workers' --threads does (services/worker/cli.py)
torch.set_num_interop_threads(1)
from pdserve.shared.config import RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
tokens, quant = int(sys.argv[1]), sys.argv[2] or None
engine = Engine(RuntimeConfig(model_path=str(resolve_model_path(None)), quantization=quant,
                              scheduler=SchedulerConfig(max_running_requests=64)))
gaps = []
for rid in ("warm", "one"):
    times = []
    req = Req(rid=rid, input_ids=list(range(100, 164)), params=SamplingParams(temperature=0, max_new_tokens=tokens,
              ignore_eos=True), on_output=lambda out: times.extend([time.perf_counter()] * len(out.token_ids)))
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
print(statistics.median(gaps) * 1000)
"""


def in_process_step(tokens: int, quantization: str, threads: int, pythonpath: str | None) -> float:
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(tokens), quantization, str(threads)],
                         capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.split()[-1])


def worker(label: str, path: str | None, extra: list[str], args: argparse.Namespace, tag: str) -> tuple[float, float]:
    proc, addr = start(label, path, extra)
    try:
        return measure(addr, args.tokens, args.streams, tag)
    finally:
        proc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="1f637ac", help="the commit to compare with")
    ap.add_argument("--after", default="", help="a commit to measure instead of this checkout's working tree")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="compute threads of every arm's process (default: %(default)s, every core here)")
    ap.add_argument("--quantization", default="", choices=["", "w8a8_int8"])
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads take a positive number")
    extra = ["--threads", str(args.threads), *(["--quantization", args.quantization] if args.quantization else [])]
    itl: dict[str, list[float]] = {"before": [], "after": [], "in-process": []}
    tps: dict[str, list[float]] = {"before": [], "after": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-engine-process-") as tmp:
        for rev in ("before", "after"):
            (Path(tmp) / rev).mkdir()
        paths = {"before": str(layout(args.before, Path(tmp) / "before")),
                 "after": str(layout(args.after, Path(tmp) / "after")) if args.after else None}
        # Every arm's process runs from here: run from the checkout, `python -m pdserve` and `-c` put it first
        # on sys.path and its pdserve/ won over PYTHONPATH, so the "before" workers ran this checkout's code.
        os.chdir(tmp)
        for r in range(args.rounds):
            for arm in order(list(itl), r):
                if arm == "in-process":
                    itl[arm].append(in_process_step(args.tokens, args.quantization, args.threads, paths["after"]))
                    print(f"round {r + 1} {arm:>10}: step {itl[arm][-1]:6.2f} ms", flush=True)
                    continue
                gap, rate = worker(arm, paths[arm], extra, args, f"{arm}{r}")
                itl[arm].append(gap)
                tps[arm].append(rate)
                print(f"round {r + 1} {arm:>10}: 1-stream ITL p50 {gap:6.2f} ms, {args.streams} streams "
                      f"{rate:7.1f} tok/s", flush=True)
    step = Spread.of(itl["in-process"])
    print(f"\n{args.rounds} rounds, arms in rotating order, {args.threads} compute thread(s) each, "
          f"{time.monotonic() - started:.0f} s; median (lowest-highest) over the rounds")
    print(f"in-process step (engine alone, 1 request): {step.text()} ms")
    print(f"{'':>8} {'ITL p50 ms':>22} {'above step':>11} {f'{args.streams} streams tok/s':>26}")
    for arm in ("before", "after"):
        gap = Spread.of(itl[arm])
        print(f"{arm:>8} {gap.text():>22} {gap.median - step.median:>+11.2f} {Spread.of(tps[arm]).text('.1f'):>26}")
    above = Spread.of([a - s for a, s in zip(itl["after"], itl["in-process"])])
    throughput = Ratio.of(tps["after"], tps["before"])
    print(f"after - in-process step, per round: {above.text('+.2f')} ms")
    print(f"after / before, {args.streams} streams tok/s: {throughput.text()}")
    itl_a, limit = statistics.median(itl["after"]), step.median + 0.5
    ok_itl, ok_tps = itl_a <= limit, throughput.of_medians >= 1.0
    print(f"\ntarget: 1-stream ITL p50 <= in-process step + 0.5 ms: {itl_a:.2f} <= {limit:.2f}: "
          f"{'met' if ok_itl else 'MISSED'}")
    print(f"target: {args.streams}-stream throughput >= 1.0x before: {throughput.of_medians:.2f}x: "
          f"{'met' if ok_tps else 'MISSED'}")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    return 0 if ok_itl and ok_tps else 1


if __name__ == "__main__":
    sys.exit(main())
