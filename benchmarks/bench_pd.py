"""Disaggregated serving against colocated, measured in one run on this machine.

    .venv/bin/python benchmarks/bench_pd.py [--backend nixl] [--seconds 40]

1. TTFT of a 2,048-token prompt through prefill+decode, broken into prefill queue,
   prefill compute, KV transfer, and the first decode step.
2. A mixed workload (a steady stream of decodes while long prompts arrive) on a
   colocated worker with all cores versus a prefill and a decode worker pinned to
   one core each: p50/p99 inter-token latency and output throughput of both.
(Raw KV-transfer bandwidth against NIXL is in benchmarks/bench_transfer.py.)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from procs import free_port  # noqa: E402

from pdserve.proto import worker_pb2 as pb  # noqa: E402
from pdserve.proto import worker_pb2_grpc as pb_grpc  # noqa: E402
from pdserve.shared.cluster_auth import worker_channel  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams, to_proto  # noqa: E402


class Worker:
    def __init__(self, role: str, cores: str | None, threads: int, *extra: str) -> None:
        self.port, self.http = free_port(), free_port()
        cmd = [sys.executable, "-m", "pdserve", role, "--port", str(self.port), "--http-port", str(self.http),
               "--threads", str(threads), "--max-total-tokens", "32768", *extra]
        if cores is not None:
            cmd = ["taskset", "-c", cores, *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addr = f"127.0.0.1:{self.port}"

    def wait(self, timeout: float = 180) -> Worker:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=1):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode}")
                time.sleep(0.3)
        raise RuntimeError("worker did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


async def stream(addr: str, ids: list[int], prefill: str, max_new: int):
    """Yield (arrival time, message) for one request."""
    req = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, prefill_addr=prefill,
                             sampling=to_proto(SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)))
    async with worker_channel(addr) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(req, timeout=600):
            yield time.perf_counter(), msg


def prompt(n: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + 31 * k) % 40000 for k in range(n)]


async def ttft_breakdown(decode: Worker, prefill: Worker, reps: int = 5) -> None:
    rows = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        times, first = [], None
        async for t, msg in stream(decode.addr, prompt(2048, rep), prefill.addr, 2):
            times.append(t)
            first = first or msg
        if rep:  # the first request warms connections
            rows.append((times[0] - t0, first.prefill_queue_s, first.prefill_compute_s, first.transfer_s,
                         times[1] - times[0]))
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"TTFT 2048-token prompt (median of {reps}): total {med[0] * 1e3:.0f} ms = prefill queue "
          f"{med[1] * 1e3:.0f} + compute {med[2] * 1e3:.0f} + transfer {med[3] * 1e3:.1f} ms + rest "
          f"{(med[0] - med[1] - med[2] - med[3]) * 1e3:.0f} ms; first decode step {med[4] * 1e3:.0f} ms")


async def mixed(decode_addr: str, prefill_addr: str, seconds: float, chatters: int = 8) -> tuple[list[float], int]:
    gaps: list[float] = []
    tokens = 0
    stop_at = time.perf_counter() + seconds

    async def chatter(i: int) -> None:
        nonlocal tokens
        salt = 1000 * i
        while time.perf_counter() < stop_at:
            last = None
            salt += 1
            async for t, msg in stream(decode_addr, prompt(32, salt), prefill_addr, 64):
                n = sum(len(c.token_ids) for c in msg.choices)
                tokens += n
                if last is not None and n:
                    gaps.append((t - last) / n)
                last = t

    async def long_prompts() -> None:
        k = 0
        while time.perf_counter() < stop_at:
            k += 1
            async for _ in stream(decode_addr, prompt(1024, 10_000 + k), prefill_addr, 4):
                pass
            await asyncio.sleep(1.0)

    t0 = time.perf_counter()
    await asyncio.gather(*(chatter(i) for i in range(chatters)), long_prompts())
    return gaps, tokens / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main_async(args) -> None:
    cores = os.cpu_count() or 2
    prefill = Worker("prefill", "0", 1, "--transfer-backend", args.backend).wait()
    decode = Worker("decode", "1" if cores > 1 else "0", 1, "--transfer-backend", args.backend,
                    "--prefill", f"127.0.0.1:{prefill.port}").wait()
    try:
        await ttft_breakdown(decode, prefill)
        pd_gaps, pd_tps = await mixed(decode.addr, prefill.addr, args.seconds)
    finally:
        decode.stop()
        prefill.stop()
    colo = Worker("colocated", None, cores).wait()
    try:
        co_gaps, co_tps = await mixed(colo.addr, "", args.seconds)
    finally:
        colo.stop()
    print(f"mixed workload, {args.seconds:.0f} s, 8 streams of 64 tokens + a 1024-token prompt every ~1 s:")
    for name, gaps, tps in (("colocated", co_gaps, co_tps), ("PD", pd_gaps, pd_tps)):
        print(f"  {name:>9}: ITL p50 {pct(gaps, .5) * 1e3:6.1f} ms  p99 {pct(gaps, .99) * 1e3:6.1f} ms  "
              f"output {tps:6.1f} tok/s")
    print(f"  PD/colocated: p99 ITL {pct(pd_gaps, .99) / pct(co_gaps, .99):.2f}x, throughput {pd_tps / co_tps:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--seconds", type=float, default=40)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
