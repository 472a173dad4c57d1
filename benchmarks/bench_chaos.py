"""Chaos benchmark: streaming load on a PD system while prefill and decode workers are SIGKILLed and restarted.

    .venv/bin/python benchmarks/bench_chaos.py [--duration 600] [--streams 32] [--prefill 2] [--decode 2]

Starts prefill and decode workers (the default model unless --model-path), and a gateway, all real processes on
loopback sharing a cluster token. `--streams` clients each stream greedy completions back to back. First a calm
phase (`--calm` seconds, no kills) measures the throughput baseline; then for `--duration` seconds a killer
SIGKILLs a random prefill or decode worker every 30-60 s and starts it again on the same ports.

Every request ends one of three ways, reported with counts:
- completed: all its tokens (some moved to another pair mid-stream: the gateway's migration counter);
- failed: an error reached the client; how long after its last token (must be within 5 s: a clear error,
  not a stall);
- hung: no token for --hang-after seconds (must be 0).
At the end: pages still held on each worker once idle (must be 0), pool integrity, and the RSS of the gateway
and the workers over time. Exits 1 when a request hung, an error came later than 5 s, or a page leaked.
Not part of the test suite (it runs for minutes); a short version of it is tests/integration/test_migration_chaos.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from procs import Proc, free_port  # noqa: E402

from pdserve.proto import worker_pb2 as pb  # noqa: E402
from pdserve.proto import worker_pb2_grpc as pb_grpc  # noqa: E402
from pdserve.shared.cluster_auth import TOKEN_ENV, worker_channel  # noqa: E402

CLEAR_ERROR_S = 5.0
PROMPTS = ["Tell me a story about a dragon.", "Explain how a bicycle works.", "Write a poem about the sea.",
           "Describe a day in a busy city.", "What makes a good cup of tea?", "List facts about the moon."]


@dataclass
class Worker:
    role: str
    port: int
    args: list[str]
    proc: Proc | None = None
    restarts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, env: dict) -> None:
        self.proc = Proc(f"{self.role}:{self.port}", self.args, health_url=f"http://127.0.0.1:{self.port + 1}/health")
        self.proc.start(env)


@dataclass
class Outcome:
    phase: str
    status: str  # completed | failed | hung
    tokens: int
    seconds: float
    error: str = ""
    error_after_last_token_s: float = 0.0


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    rss: list[dict] = field(default_factory=list)  # {"t": s, service: MiB}
    phase: str = "calm"


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def client_loop(client: openai.AsyncOpenAI, run: Run, stop: asyncio.Event, args, index: int) -> None:
    n = 0
    while not stop.is_set():
        prompt = f"{PROMPTS[(index + n) % len(PROMPTS)]} (#{index}-{n})"
        n += 1
        phase, start = run.phase, time.monotonic()
        last, tokens, finish = start, 0, None
        try:
            stream = await client.completions.create(model="default", prompt=prompt, max_tokens=args.max_tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True})
            iterator = stream.__aiter__()
            while True:
                try:
                    chunk = await asyncio.wait_for(iterator.__anext__(), args.hang_after)
                except StopAsyncIteration:
                    break
                for choice in chunk.choices:
                    tokens += bool(choice.text)
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                last = time.monotonic()
            status = "completed" if finish is not None else "failed"
            run.outcomes.append(Outcome(phase, status, tokens, time.monotonic() - start,
                                        "" if finish else "the stream ended without a finish reason",
                                        0.0 if finish else time.monotonic() - last))
        except asyncio.TimeoutError:
            run.outcomes.append(Outcome(phase, "hung", tokens, time.monotonic() - start,
                                        f"no token for {args.hang_after:g} s"))
        except openai.APIError as exc:
            now = time.monotonic()
            run.outcomes.append(Outcome(phase, "failed", tokens, now - start, str(exc)[:200], now - last))


async def killer(workers: list[Worker], run: Run, stop: asyncio.Event, env: dict, args) -> None:
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    while True:
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(args.kill_min, args.kill_max))
            return
        except asyncio.TimeoutError:
            pass
        victim = rng.choice([w for w in workers if w.proc.alive()])
        victim.proc.kill()
        killed_at = time.monotonic()
        victim.start(env)
        victim.restarts += 1
        try:
            await asyncio.to_thread(victim.proc.wait_healthy, 300)
            healthy_s = time.monotonic() - killed_at
        except RuntimeError as exc:
            healthy_s = float("nan")
            print(f"  {victim.role} {victim.address} did not come back: {exc}", flush=True)
        run.kills.append({"t": round(killed_at - t0, 1), "worker": f"{victim.role} {victim.address}",
                          "back_after_s": round(healthy_s, 1)})
        print(f"  [{killed_at - t0:6.1f} s] killed {victim.role} {victim.address}; healthy again after "
              f"{healthy_s:.1f} s", flush=True)


async def sample_rss(gateway: Proc, workers: list[Worker], run: Run, stop: asyncio.Event, every: float) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        row = {"t": round(time.monotonic() - t0), "gateway": rss_mib(gateway.popen.pid)}
        for w in workers:
            row[f"{w.role}:{w.port}"] = rss_mib(w.proc.popen.pid) if w.proc.alive() else None
        run.rss.append(row)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


def counter(url: str, name: str) -> float:
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + "_total"))


def pool_after_idle(address: str, timeout: float = 60.0) -> pb.PoolStats:
    async def ask() -> pb.PoolStats:
        async with worker_channel(address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            deadline = time.monotonic() + timeout
            while True:
                stats = await stub.Stats(pb.Empty(), timeout=10)
                if stats.used_pages == 0 or time.monotonic() > deadline:
                    return stats
                await asyncio.sleep(0.5)
    return asyncio.run(ask())


def summary(run: Run, phase: str, seconds: float) -> dict:
    outs = [o for o in run.outcomes if o.phase == phase]
    done = [o for o in outs if o.status == "completed"]
    failed = [o for o in outs if o.status == "failed"]
    return {"requests": len(outs), "completed": len(done), "failed": len(failed),
            "hung": sum(o.status == "hung" for o in outs),
            "tokens_per_s": round(sum(o.tokens for o in outs) / seconds, 1),
            "slowest_error_s": round(max((o.error_after_last_token_s for o in failed), default=0.0), 2),
            "errors": sorted({o.error for o in failed})[:5]}


async def load(url: str, run: Run, workers: list[Worker], gateway: Proc, env: dict, args) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=args.hang_after * 4)
    stop, stop_killer = asyncio.Event(), asyncio.Event()
    clients = [asyncio.create_task(client_loop(client, run, stop, args, i)) for i in range(args.streams)]
    sampler = asyncio.create_task(sample_rss(gateway, workers, run, stop, args.rss_every))
    print(f"calm phase: {args.calm:g} s, {args.streams} streams", flush=True)
    await asyncio.sleep(args.calm)
    migrated_before = counter(url, "pdserve_gateway_migrations")
    run.phase = "chaos"
    print(f"chaos phase: {args.duration:g} s, a worker killed every {args.kill_min:g}-{args.kill_max:g} s", flush=True)
    kills = asyncio.create_task(killer(workers, run, stop_killer, env, args))
    await asyncio.sleep(args.duration)
    stop_killer.set()
    await kills  # the last victim is back before the load stops
    stop.set()
    await asyncio.gather(*clients)
    await sampler
    await client.close()
    return {"migrated": int(counter(url, "pdserve_gateway_migrations") - migrated_before),
            "retried": int(counter(url, "pdserve_gateway_retries"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="model (default: the default model)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of chaos")
    parser.add_argument("--calm", type=float, default=60.0, help="seconds of load before the first kill")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kill-min", type=float, default=30.0)
    parser.add_argument("--kill-max", type=float, default=60.0)
    parser.add_argument("--hang-after", type=float, default=60.0, help="seconds without a token that count as hung")
    parser.add_argument("--rss-every", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--transfer-backend", default="tcp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args()

    from pdserve.shared.model_files import resolve_model_path
    model = str(resolve_model_path(args.model_path, quiet=True))
    env = {TOKEN_ENV: secrets.token_urlsafe(32), "OMP_NUM_THREADS": str(args.threads)}
    os.environ[TOKEN_ENV] = env[TOKEN_ENV]  # for this process's own Stats calls
    common = ["--model-path", model, "--threads", str(args.threads), "--transfer-backend", args.transfer_backend,
              "--enable-deterministic-inference"]

    def worker(role: str, extra: list[str]) -> Worker:
        port = free_port()
        while not all(_free(p) for p in (port + 1, port + 2)):
            port = free_port()
        return Worker(role, port, [role, "--port", str(port), "--http-port", str(port + 1), *common, *extra])

    prefills = [worker("prefill", []) for _ in range(args.prefill)]
    to_prefills = [a for w in prefills for a in ("--prefill", w.address)]
    decodes = [worker("decode", ["--transfer-port", "0", *to_prefills]) for _ in range(args.decode)]
    for d in decodes:
        d.args[d.args.index("--transfer-port") + 1] = str(d.port + 2)
    workers = prefills + decodes
    port = free_port()
    gateway = Proc("gateway", ["gateway", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
                               "--health-check-interval", "0.5", *to_prefills,
                               *[a for w in decodes for a in ("--decode", w.address)]],
                   health_url=f"http://127.0.0.1:{port}/health")
    url = f"http://127.0.0.1:{port}"
    run = Run()
    try:
        for w in workers:
            w.start(env)
        gateway.start({**env, "OMP_NUM_THREADS": "1"})
        for p in [w.proc for w in workers] + [gateway]:
            p.wait_healthy(600)
        counts = asyncio.run(load(url, run, workers, gateway, env, args))
        pools = {w.address: pool_after_idle(w.address) for w in workers}
    finally:
        for p in [gateway] + [w.proc for w in workers if w.proc is not None]:
            p.stop()

    calm, chaos = summary(run, "calm", args.calm), summary(run, "chaos", args.duration)
    leaked = {a: s.used_pages for a, s in pools.items()}
    report = {"setup": {"prefill": args.prefill, "decode": args.decode, "streams": args.streams,
                        "max_tokens": args.max_tokens, "model": Path(model).name, "threads": args.threads,
                        "transfer": args.transfer_backend, "cpus": os.cpu_count()},
              "calm": calm, "chaos": {**chaos, **counts, "kills": len(run.kills)},
              "throughput_chaos_over_calm": round(chaos["tokens_per_s"] / max(calm["tokens_per_s"], 1e-9), 2),
              "pages_leaked": leaked, "integrity_ok": all(s.integrity_ok for s in pools.values()),
              "kills": run.kills, "rss_mib": run.rss}
    print(json.dumps({k: v for k, v in report.items() if k != "rss_mib"}, indent=1))
    print("RSS (MiB) every minute:")
    for row in run.rss[:: max(1, int(60 / args.rss_every))]:
        print("  " + "  ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    bad = (chaos["hung"] + calm["hung"] or chaos["slowest_error_s"] > CLEAR_ERROR_S or any(leaked.values())
           or not report["integrity_ok"])
    return 1 if bad else 0


def _free(port: int) -> bool:
    import socket
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


if __name__ == "__main__":
    sys.exit(main())
