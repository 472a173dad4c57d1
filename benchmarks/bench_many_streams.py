"""1,000 concurrent streams through one gateway: every one is served or refused at once, none is dropped, and the
gateway's memory stays bounded.

    .venv/bin/python benchmarks/bench_many_streams.py [--streams 1000] [--tokens 64]

A colocated worker on a tiny random model (what is measured is the gateway, not the model: a tiny model keeps
the worker fast enough to drive a thousand streams on a laptop) and a gateway in front of it, both real
processes. `--streams` clients open streaming completions at once and read them to the end. The gateway admits
what the worker runs plus --max-queued-requests (default 256 here as in production); the rest must get 429 with
Retry-After. Then, with the gateway full of long streams, 50 requests one after another must each be refused
within --refusal-ms (median; in the burst, refusals wait their turn behind the admitted requests' set-up on the
event loop). Reports streams completed, refused, failed; gateway RSS idle, at peak and after; the peak's growth
per admitted stream. Exits 1 when a stream failed or hung, a refusal came late, or the gateway did not return to
within 50 MB of its idle RSS.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures import make_tiny_model  # noqa: E402
from procs import Proc, free_port, start_worker  # noqa: E402

MB = 1e6


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int, timeout_s: float) -> dict:
    start = time.monotonic()
    body = {"model": "default", "prompt": "hello there", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status == 429:
                await r.read()
                return {"outcome": "refused", "ms": (time.monotonic() - start) * 1000,
                        "retry_after": r.headers.get("Retry-After")}
            if r.status != 200:
                return {"outcome": "failed", "why": f"{r.status} {(await r.text())[:200]}"}
            finished = False
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return {"outcome": "failed", "why": line[:200]}
                finished = finished or any(c.get("finish_reason") == "length" for c in event.get("choices", []))
            return {"outcome": "completed" if finished else "failed", "why": "" if finished else "no finish",
                    "s": time.monotonic() - start}
    except asyncio.TimeoutError:
        return {"outcome": "hung"}
    except aiohttp.ClientError as exc:
        return {"outcome": "failed", "why": repr(exc)}


async def run(url: str, streams: int, tokens: int, timeout_s: float) -> list[dict]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        return await asyncio.gather(*(one_stream(session, url, tokens, timeout_s) for _ in range(streams)))


async def refusals_when_full(url: str, admitted: int, probes: int, timeout_s: float) -> tuple[list[dict], list[dict]]:
    """`admitted` long streams fill the gateway; once it holds them all, `probes` requests one after another must
    each be refused at once. Returns (the streams' outcomes, the probes' outcomes)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        streams = [asyncio.create_task(one_stream(session, url, 4096, timeout_s)) for _ in range(admitted)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            async with session.get(url + "/status.json") as r:
                held = (await r.json())["requests"]
            if held["running"] + held["queued"] >= admitted:
                break
            await asyncio.sleep(0.05)
        probes_out = [await one_stream(session, url, 4, timeout_s) for _ in range(probes)]
        return await asyncio.gather(*streams), probes_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=256, help="the worker's --max-running-requests")
    parser.add_argument("--max-queued", type=int, default=256, help="the gateway's --max-queued-requests")
    parser.add_argument("--refusal-ms", type=float, default=50.0, help="how fast a 429 must come (median)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()

    model = make_tiny_model("llama", Path(tempfile.mkdtemp(prefix="pdserve-streams-")) / "llama")
    worker, addr = start_worker("colocated", str(model), "--max-running-requests", str(args.max_running),
                                "--dtype", "float32", threads=1)
    port = free_port()
    gateway = Proc("gateway", ["gateway", "--model-path", str(model), "--port", str(port), "--worker", addr,
                               "--max-queued-requests", str(args.max_queued)],
                   health_url=f"http://127.0.0.1:{port}/health")
    try:
        worker.wait_healthy(300)
        gateway.start({"OMP_NUM_THREADS": "1"}).wait_healthy(120)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(run(url, 8, 4, 60))  # warm up
        time.sleep(1.0)
        idle = rss(gateway.popen.pid)
        peak = [idle]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss(gateway.popen.pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        results = asyncio.run(run(url, args.streams, args.tokens, args.timeout))
        seconds = time.monotonic() - t0
        stop.set()
        sampler.join()
        time.sleep(2.0)
        after = rss(gateway.popen.pid)
        full_streams, probes = asyncio.run(refusals_when_full(url, args.max_running + args.max_queued, 50,
                                                              args.timeout))
        alive = gateway.alive() and worker.alive()
    finally:
        gateway.stop()
        worker.stop()

    count = {k: sum(r["outcome"] == k for r in results) for k in ("completed", "refused", "failed", "hung")}
    herd_ms = [r["ms"] for r in results if r["outcome"] == "refused"]
    refusal_ms = [r["ms"] for r in probes if r["outcome"] == "refused"]
    full_count = {k: sum(r["outcome"] == k for r in full_streams) for k in ("completed", "refused", "failed", "hung")}
    report = {"streams": args.streams, "tokens": args.tokens, **count, "seconds": round(seconds, 1),
              "burst_refusal_ms_median": round(statistics.median(herd_ms), 1) if herd_ms else None,
              "refusals_with_retry_after": sum(1 for r in results if r.get("retry_after")),
              "when_full": {"streams": full_count, "probes_refused": len(refusal_ms),
                            "refusal_ms_median": round(statistics.median(refusal_ms), 1) if refusal_ms else None,
                            "refusal_ms_p95": round(sorted(refusal_ms)[int(0.95 * (len(refusal_ms) - 1))], 1)
                            if refusal_ms else None,
                            "refusal_ms_max": round(max(refusal_ms), 1) if refusal_ms else None},
              "gateway_rss_mb": {"idle": round(idle / MB, 1), "peak": round(peak[0] / MB, 1),
                                 "after": round(after / MB, 1)},
              "peak_growth_per_admitted_stream_kb": round((peak[0] - idle) / 1e3 / max(1, count["completed"]), 1),
              "processes_alive": alive,
              "failures": sorted({r.get("why", "") for r in results if r["outcome"] == "failed"})[:5]}
    print(json.dumps(report, indent=1))
    ok = (count["failed"] == 0 and count["hung"] == 0 and alive and after - idle < 50 * MB
          and report["refusals_with_retry_after"] == count["refused"]
          and len(refusal_ms) == len(probes) and statistics.median(refusal_ms) <= args.refusal_ms
          and full_count["failed"] == full_count["hung"] == full_count["refused"] == 0)
    print("targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
