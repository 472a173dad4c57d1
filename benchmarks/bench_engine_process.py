"""What serving costs above the engine's own step, before and after the engine got a process of its own.

    .venv/bin/python benchmarks/bench_engine_process.py [--before REV] [--rounds 2] [--tokens 128] [--streams 32]

Lays out the project at REV (default: the last commit whose workers ran the engine in their own process,
1f637ac) beside this checkout, then alternates, `--rounds` times: a colocated worker of the default model from
REV, then one from this checkout, each measured by a gRPC client on loopback (the worker's Generate stream; no
gateway in between, so what is measured is the worker): the inter-token gap p50 of one stream, and the output
tokens per second of `--streams` concurrent streams. The in-process figure is the engine's own: the gap between
one request's outputs with the engine stepping in this process (no gRPC, no channel). Prints each figure,
median over the rounds, and the issue's two CPU targets beside them:
- 1-stream ITL p50 <= the in-process step + 0.5 ms (this checkout);
- 32-stream throughput >= 1.0x before.
"""
from __future__ import annotations

import argparse
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


def in_process_step(tokens: int, quantization: str) -> float:
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(tokens), quantization], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    return float(out.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="1f637ac", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--quantization", default="", choices=["", "w8a8_int8"])
    args = ap.parse_args()
    extra = ["--quantization", args.quantization] if args.quantization else []
    figures: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="bench-engine-process-") as tmp:
        before_path = str(layout(args.before, Path(tmp)))
        for r in range(args.rounds):
            for label, path in (("before", before_path), ("after", None)):
                proc, addr = start(label, path, extra)
                try:
                    figures[label].append(measure(addr, args.tokens, args.streams, f"{label}{r}"))
                finally:
                    proc.stop()
                itl, tps = figures[label][-1]
                print(f"round {r + 1} {label:>6}: 1-stream ITL p50 {itl:6.2f} ms, {args.streams} streams "
                      f"{tps:7.1f} tok/s", flush=True)
    step = in_process_step(args.tokens, args.quantization)
    med = {k: (statistics.median(i for i, _ in v), statistics.median(t for _, t in v)) for k, v in figures.items()}
    tps_b, (itl_a, tps_a) = med["before"][1], med["after"]
    print(f"\nin-process step (engine alone, 1 request): {step:.2f} ms")
    print(f"{'':>8} {'ITL p50 ms':>11} {'above step':>11} {f'{args.streams} streams tok/s':>20}")
    for label, (itl, tps) in med.items():
        print(f"{label:>8} {itl:>11.2f} {itl - step:>+11.2f} {tps:>20.1f}")
    ok_itl, ok_tps = itl_a <= step + 0.5, tps_a >= tps_b
    print(f"\ntarget: 1-stream ITL p50 <= in-process step + 0.5 ms: {itl_a:.2f} <= {step + 0.5:.2f}: "
          f"{'met' if ok_itl else 'MISSED'}")
    print(f"target: {args.streams}-stream throughput >= 1.0x before: {tps_a / tps_b:.2f}x: "
          f"{'met' if ok_tps else 'MISSED'}")
    return 0 if ok_itl and ok_tps else 1


if __name__ == "__main__":
    sys.exit(main())
