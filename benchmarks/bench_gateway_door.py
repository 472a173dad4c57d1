"""The gateway's door: large request bodies and large answers beside ordinary streams of the same gateway process.

    .venv/bin/python benchmarks/bench_gateway_door.py [--streams 16] [--echo-tokens 8190] [--rounds 1]

One colocated worker behind one gateway process. Each case runs `--streams` streaming chat completions and, once
every stream has its first token, sends its large request(s); the streams go on until those are answered and
`--linger` seconds more, and are then closed. Meanwhile /live is asked every 20 ms. For each case it prints the
status(es) of the large requests, the largest gap between two events of any stream while they were in flight,
and the slowest /live, beside the same figures for the streams alone measured just before it (the baseline, in the
same run; with --rounds N, the medians of N such pairs). Target: no stream's gap over 100 ms (on a 2-core CPU the
decode steps of 16 streams alone come close to it: read each gap beside its baseline).

Cases: a chat completion with 4,000,000 stop_token_ids (~11 MiB, refused); 16 chat completions at once, each
with a logit_bias over the whole vocabulary (refused); a /v1/completions of an `--echo-tokens`-token prompt
with echo and logprobs 20 (a ~4 MiB answer for 8,190 tokens). The worker computes that prompt's prefill beside
the streams, which lengthens their decode steps whatever the gateway does: in that case /live, which only the
gateway answers, is the measure of the gateway's event loop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from procs import Proc, free_port, start_worker  # noqa: E402

TARGET_MS = 100.0
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
JSON = {"Content-Type": "application/json"}


@dataclass
class Large:
    """One case's large requests: (path, body as sent) each, all sent at once."""
    name: str
    requests: list[tuple[str, bytes]]


@dataclass
class Outcome:
    name: str
    statuses: list[int] = field(default_factory=list)
    body_mib: float = 0.0
    answer_mib: float = 0.0
    max_gap_ms: float = 0.0
    live_max_ms: float = 0.0
    seconds: float = 0.0


def stop_ids_body(n: int) -> bytes:
    head = json.dumps(CHAT)[:-1].encode()
    return head + b', "stop_token_ids": [' + b"7, " * (n - 1) + b"7]}"


def logit_bias_body(vocab: int) -> bytes:
    return json.dumps({**CHAT, "logit_bias": {str(t): -100 for t in range(vocab)}}).encode()


def echo_body(tokens: int) -> bytes:
    prompt = [100 + (31 * k) % 40000 for k in range(tokens)]
    return json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 20}).encode()


async def stream(session: aiohttp.ClientSession, url: str, i: int, events: list[float], started: asyncio.Event,
                 stop: asyncio.Event) -> None:
    """One streaming chat completion, its events' arrival times in `events`, until `stop` (then it is closed)."""
    body = {"messages": [{"role": "user", "content": f"Count to {i + 5}, slowly."}], "stream": True,
            "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(time.perf_counter())
                started.set()
                if stop.is_set():
                    return


async def probe_live(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, seconds: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        async with session.get(url + "/live") as r:
            await r.read()
        seconds.append(time.perf_counter() - t0)
        await asyncio.sleep(0.02)


async def send(session: aiohttp.ClientSession, url: str, path: str, body: bytes) -> tuple[int, int]:
    async with session.post(url + path, data=body, headers=JSON) as r:
        return r.status, len(await r.read())


async def run_case(url: str, streams: int, large: Large | None, alone_s: float, linger_s: float) -> Outcome:
    """The streams, and once each has begun the large requests; the gaps counted from then until the end."""
    out = Outcome(large.name if large else f"{streams} streams alone")
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session, \
            aiohttp.ClientSession(timeout=timeout) as probe_session:
        stop, probe_stop = asyncio.Event(), asyncio.Event()
        events: list[list[float]] = [[] for _ in range(streams)]
        starts = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(stream(session, url, i, events[i], starts[i], stop)) for i in range(streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts)), 600)
        await asyncio.sleep(0.5)  # past the first decode steps
        live: list[float] = []
        prober = asyncio.create_task(probe_live(probe_session, url, probe_stop, live))
        begin = time.perf_counter()
        if large is None:
            await asyncio.sleep(alone_s)
        else:
            out.body_mib = sum(len(b) for _, b in large.requests) / len(large.requests) / (1 << 20)
            answers = await asyncio.gather(*(send(session, url, path, body) for path, body in large.requests))
            out.statuses = [status for status, _ in answers]
            out.answer_mib = max(size for _, size in answers) / (1 << 20)
        out.seconds = time.perf_counter() - begin
        await asyncio.sleep(linger_s)
        end = time.perf_counter()
        probe_stop.set()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, prober, return_exceptions=True), 120)
    gaps = [b - a for times in events for a, b in zip(times, times[1:]) if a < end and b > begin]
    out.max_gap_ms = max(gaps, default=0.0) * 1e3
    out.live_max_ms = max(live, default=0.0) * 1e3
    return out


def start_system(model_path: str | None) -> tuple[list[Proc], str]:
    threads = os.cpu_count() or 2
    # Room in the KV pool for the streams and the echoed prompt together.
    worker, addr = start_worker("colocated", model_path, "--max-total-tokens", "65536", threads=threads)
    procs = [worker.wait_healthy(300)]
    port = free_port()
    args = ["gateway", "--port", str(port), "--worker", addr, *(["--model-path", model_path] if model_path else [])]
    gateway = Proc("gateway", args, health_url=f"http://127.0.0.1:{port}/health").start({"OMP_NUM_THREADS": "1"})
    procs.append(gateway.wait_healthy(120))
    return procs, f"http://127.0.0.1:{port}"


def vocab_size(model_path: str | None) -> int:
    from pdserve.shared.model_files import resolve_model_path

    return json.loads((resolve_model_path(model_path, quiet=True) / "config.json").read_text())["vocab_size"]


@dataclass
class Row:
    """One case over its rounds, each round the streams alone then beside the case: medians of each figure."""
    case: Outcome
    alone: Outcome


def median_of(outcomes: list[Outcome]) -> Outcome:
    """Each figure's median; the statuses of one round, or of all when they differ."""
    same = all(o.statuses == outcomes[0].statuses for o in outcomes)
    out = Outcome(outcomes[0].name, outcomes[0].statuses if same else [s for o in outcomes for s in o.statuses])
    for name in ("body_mib", "answer_mib", "max_gap_ms", "live_max_ms", "seconds"):
        setattr(out, name, statistics.median(getattr(o, name) for o in outcomes))
    return out


def table(rows: list[Row]) -> str:
    lines = [f"{'case':<34} {'answered':<10} {'body MiB':>8} {'answer MiB':>10} {'s':>6} {'max gap ms':>10} "
             f"{'alone ms':>8} {'/live max':>9} {'alone':>6}  gap <= {TARGET_MS:g} ms"]
    for row in rows:
        r = row.case
        statuses = sorted(set(r.statuses))
        answered = ",".join(map(str, statuses)) + (f" x{len(r.statuses)}" if len(r.statuses) > 1 else "")
        lines.append(f"{r.name:<34} {answered:<10} {r.body_mib:8.2f} {r.answer_mib:10.2f} {r.seconds:6.1f} "
                     f"{r.max_gap_ms:10.0f} {row.alone.max_gap_ms:8.0f} {r.live_max_ms:9.1f} "
                     f"{row.alone.live_max_ms:6.1f}  {'met' if r.max_gap_ms <= TARGET_MS else 'missed'}")
    return "\n".join(lines)


async def main_async(args) -> None:
    vocab = vocab_size(args.model_path)
    cases = [Large(f"stop_token_ids x {args.stop_ids:,}", [("/v1/chat/completions", stop_ids_body(args.stop_ids))]),
             Large(f"{args.bias_requests} x logit_bias x {vocab:,}",
                   [("/v1/chat/completions", logit_bias_body(vocab))] * args.bias_requests),
             Large(f"echo+logprobs 20, {args.echo_tokens:,} tokens", [("/v1/completions", echo_body(args.echo_tokens))])]
    procs, url = start_system(args.model_path)
    rows = []
    try:
        await run_case(url, args.streams, None, 1.0, 0.0)  # warm-up: code paths, connections, the worker's graphs
        for case in cases:
            alone, beside = [], []
            for _ in range(args.rounds):  # the streams alone just before each: the machine's load drifts
                alone.append(await run_case(url, args.streams, None, args.alone, args.linger))
                beside.append(await run_case(url, args.streams, case, 0.0, args.linger))
            rows.append(Row(median_of(beside), median_of(alone)))
    finally:
        for p in reversed(procs):
            p.stop()
    print(f"{args.streams} streaming chat completions on one colocated worker (threads={os.cpu_count()}) behind one "
          f"gateway process; the largest gap between two events of a stream while the large requests were in "
          f"flight, and the slowest /live, beside the same for the streams alone just before (median of "
          f"{args.rounds} round(s)):")
    print(table(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stop-ids", type=int, default=4_000_000, help="stop_token_ids of the first case")
    ap.add_argument("--bias-requests", type=int, default=16, help="full-vocabulary logit_bias bodies sent at once")
    ap.add_argument("--echo-tokens", type=int, default=8190, help="prompt tokens of the echo+logprobs case")
    ap.add_argument("--alone", type=float, default=3.0, help="seconds the baseline measures the streams alone")
    ap.add_argument("--linger", type=float, default=1.0, help="seconds the streams go on after a case's answers")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of each case (medians printed)")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
