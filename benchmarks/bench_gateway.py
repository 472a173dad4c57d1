"""What the gateway adds on top of a worker, measured in one run against the same worker called directly.

    .venv/bin/python benchmarks/bench_gateway.py [--requests 40] [--streams 8] [--tokens 64]
    .venv/bin/python benchmarks/bench_gateway.py --pd     # prefill + decode behind the gateway

1. Latency: the same short request (greedy, `--latency-tokens` output tokens) sent alternately straight to
   the worker over gRPC (token ids) and through the gateway's /v1/completions (text: tokenization,
   detokenization, JSON and HTTP included); p50/p99 of each and of the added latency (each gateway request
   minus the direct request next to it, so drift in the machine cancels out).
2. Streaming: `--streams` concurrent streams of `--tokens` tokens each, direct (gRPC) and through the
   gateway (/v1/completions with stream=true, SSE), alternating for `--rounds` rounds: output tokens per
   second (median over rounds) and time to first token.
The worker is the decode worker in PD mode (with its prefill worker named), else a colocated worker.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from procs import Proc, free_port, start_worker  # noqa: E402

from pdserve.proto import worker_pb2 as pb  # noqa: E402
from pdserve.proto import worker_pb2_grpc as pb_grpc  # noqa: E402
from pdserve.shared.cluster_auth import worker_channel  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams, to_proto  # noqa: E402


def prompt(n: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + 31 * k) % 40000 for k in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Direct:
    """Requests straight to the worker, as the gateway sends them."""

    def __init__(self, addr: str, prefill: str) -> None:
        self.channel = worker_channel(addr)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.prefill = prefill

    async def run(self, ids: list[int], max_new: int) -> tuple[float | None, int]:
        """(seconds to first token, tokens) of one request; the caller times the whole."""
        req = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, prefill_addr=self.prefill, sampling=to_proto(
            SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)))
        t0, first, tokens = time.perf_counter(), None, 0
        async for msg in self.stub.Generate(req, timeout=600):
            n = sum(len(c.token_ids) for c in msg.choices)
            if n and first is None:
                first = time.perf_counter() - t0
            tokens += n
        return first, tokens


class ThroughGateway:
    def __init__(self, url: str) -> None:
        self.url = url
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def complete(self, text: str, max_new: int) -> int:
        body = {"prompt": text, "max_tokens": max_new, "temperature": 0, "ignore_eos": True}
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            out = await r.json()
            assert r.status == 200, out
            return out["usage"]["completion_tokens"]

    async def stream(self, ids: list[int], max_new: int) -> tuple[float | None, int]:
        body = {"prompt": ids, "max_tokens": max_new, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        t0, first, tokens = time.perf_counter(), None, 0
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"] and first is None:
                    first = time.perf_counter() - t0
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return first, tokens


LATENCY_PROMPT = "The capital of France is"


async def latency(direct: Direct, gateway: ThroughGateway, ids: list[int], requests: int, max_new: int) -> dict:
    for _ in range(3):  # warm connections, caches and code paths on both routes
        await direct.run(ids, max_new)
        await gateway.complete(LATENCY_PROMPT, max_new)
    direct_s, gateway_s = [], []
    for _ in range(requests):
        t0 = time.perf_counter()
        await direct.run(ids, max_new)
        direct_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await gateway.complete(LATENCY_PROMPT, max_new)
        gateway_s.append(time.perf_counter() - t0)
    added = [g - d for g, d in zip(gateway_s, direct_s)]
    return {"direct_p50_ms": pct(direct_s, .5) * 1e3, "direct_p99_ms": pct(direct_s, .99) * 1e3,
            "gateway_p50_ms": pct(gateway_s, .5) * 1e3, "gateway_p99_ms": pct(gateway_s, .99) * 1e3,
            "added_p50_ms": pct(added, .5) * 1e3, "added_p99_ms": pct(added, .99) * 1e3,
            "added_mean_ms": statistics.mean(added) * 1e3}


async def streaming_round(run, streams: int, max_new: int, salt: int) -> dict:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(run(prompt(32, salt + i), max_new) for i in range(streams)))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results if r[0] is not None]
    return {"tokens_per_s": sum(r[1] for r in results) / wall, "ttft_p50_ms": pct(ttfts, .5) * 1e3}


async def streaming(direct: Direct, gateway: ThroughGateway, rounds: int, streams: int, max_new: int) -> dict:
    runs: dict[str, list[dict]] = {"direct": [], "gateway": []}
    for r in range(rounds):  # alternate, so that neither route always runs on a warmer or quieter machine
        runs["direct"].append(await streaming_round(direct.run, streams, max_new, 1000 * r))
        runs["gateway"].append(await streaming_round(gateway.stream, streams, max_new, 1000 * r + 500))
    return {name: {key: statistics.median(x[key] for x in xs) for key in xs[0]} for name, xs in runs.items()}


def start_system(args) -> tuple[list[Proc], str, str, str]:
    """(processes, gateway URL, address to call directly, prefill address for direct calls)."""
    threads = str(max(1, (os.cpu_count() or 2) // 2)) if args.pd else str(os.cpu_count() or 2)
    procs: list[Proc] = []
    if args.pd:
        prefill, paddr = start_worker("prefill", args.model_path, threads=int(threads))
        procs.append(prefill.wait_healthy(300))
        decode, daddr = start_worker("decode", args.model_path, "--prefill", paddr, threads=int(threads))
        procs.append(decode.wait_healthy(300))
        targets, direct, direct_prefill = ["--prefill", paddr, "--decode", daddr], daddr, paddr
    else:
        worker, waddr = start_worker("colocated", args.model_path, threads=int(threads))
        procs.append(worker.wait_healthy(300))
        targets, direct, direct_prefill = ["--worker", waddr], waddr, ""
    port = free_port()
    gw_args = ["gateway", "--port", str(port), *targets]
    if args.model_path:
        gw_args += ["--model-path", args.model_path]
    gateway = Proc("gateway", gw_args, health_url=f"http://127.0.0.1:{port}/health").start({"OMP_NUM_THREADS": "1"})
    procs.append(gateway.wait_healthy(120))
    return procs, f"http://127.0.0.1:{port}", direct, direct_prefill


async def main_async(args) -> None:
    from transformers import AutoTokenizer

    from pdserve.shared.model_files import resolve_model_path

    ids = AutoTokenizer.from_pretrained(resolve_model_path(args.model_path, quiet=True)).encode(LATENCY_PROMPT)
    procs, url, addr, prefill = start_system(args)
    direct, gateway = Direct(addr, prefill), ThroughGateway(url)
    try:
        lat = await latency(direct, gateway, ids, args.requests, args.latency_tokens)
        stream = await streaming(direct, gateway, args.rounds, args.streams, args.tokens)
    finally:
        await gateway.session.close()
        await direct.channel.close()
        for p in reversed(procs):
            p.stop()
    mode = "prefill+decode" if args.pd else "colocated"
    print(f"gateway overhead ({mode} worker; {args.requests} alternating requests of {len(ids)} prompt + "
          f"{args.latency_tokens} output tokens):")
    print(f"  direct  p50 {lat['direct_p50_ms']:8.1f} ms  p99 {lat['direct_p99_ms']:8.1f} ms")
    print(f"  gateway p50 {lat['gateway_p50_ms']:8.1f} ms  p99 {lat['gateway_p99_ms']:8.1f} ms")
    print(f"  added   p50 {lat['added_p50_ms']:8.2f} ms  p99 {lat['added_p99_ms']:8.2f} ms  "
          f"(mean {lat['added_mean_ms']:.2f} ms)")
    print(f"streaming: {args.streams} concurrent streams of {args.tokens} tokens, median of {args.rounds} rounds:")
    for name, s in stream.items():
        print(f"  {name:>7}: {s['tokens_per_s']:7.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:7.1f} ms")
    print(f"  gateway/direct throughput: {stream['gateway']['tokens_per_s'] / stream['direct']['tokens_per_s']:.3f}")
    if args.json:
        print(json.dumps({"mode": mode, "latency": lat, "streaming": stream}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--pd", action="store_true", help="a prefill and a decode worker instead of a colocated one")
    ap.add_argument("--requests", type=int, default=40, help="latency samples per route")
    ap.add_argument("--latency-tokens", type=int, default=1, help="output tokens of each latency request")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="streaming rounds per route")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
