"""Migration benchmark: a decode worker running many streams leaves under load, live and by recomputation.

    .venv/bin/python benchmarks/bench_migration.py [--streams 32] [--tokens 256] [--after 48] [--model-path DIR]

Starts a prefill worker, two decode workers and a gateway (real processes on loopback, the default model unless
--model-path, one compute thread each). `--streams` greedy streams of `--tokens` tokens run at once; once each has
`--after` tokens, the decode worker holding most of them leaves, twice in one run:
- live: SIGTERM, as a rolling update sends it; the gateway moves its generations with their KV to the other
  decode worker (docs/features/migration.md) and it exits once their KV is taken;
- recompute: SIGKILL, its KV gone with it; the gateway continues each stream on the other decode worker, which
  computes prompt and output so far again.
For each: the streams moved, the seconds from the signal to the worker's exit (live), the longest wait any stream
saw for a token after the signal, the KV bytes written into the other worker's pool, the prompt tokens the other
decode worker computed (what a move recomputes), how many streams ended in an error (must be 0), and how the
gateway continued them (live, or by recomputing when a live move failed). Each round's prompts are its own, so no
round finds another's output in a cache.
Not part of the test suite; tests/services/gateway/test_live_move.py is its short, checked version.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import openai
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "services" / "gateway")]
from harness import System, start_gateway  # noqa: E402
from procs import start_worker  # noqa: E402

PROMPTS = ["Tell me a story about a dragon.", "Explain how a bicycle works.", "Write a poem about the sea.",
           "Describe a day in a busy city.", "What makes a good cup of tea?", "List facts about the moon."]


KINDS = ("live", "recompute")  # how the gateway continued each stream (pdserve_gateway_migrations_total)


def metric(url: str, name: str, match: str = "") -> float:
    """The sum of a Prometheus series' samples at `url` (those whose labels contain `match`)."""
    text = requests.get(url, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and match in line)


def metrics_url(proc) -> str:
    return proc.health_url.replace("/health", "/metrics")


def in_flight(gw) -> dict[str, int]:
    info = requests.get(gw.url + "/get_server_info", timeout=30).json()
    return {w["address"]: w["in_flight"] for w in info["workers"] if w["role"] == "decode"}


async def one_round(system: System, gw, decodes: list[str], how: str, args) -> dict:
    client = openai.AsyncOpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=600)
    counts = [0] * args.streams
    ready = asyncio.Event()
    signalled: list[float] = []
    gaps = [0.0] * args.streams  # the longest wait of each stream for a token after the signal

    async def stream(i: int) -> str:
        try:
            s = await client.completions.create(model="default", prompt=PROMPTS[i % len(PROMPTS)] + f" ({how} {i})",
                                                max_tokens=args.tokens, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
            last = None
            async for _ in s:
                now = time.monotonic()
                if signalled and last is not None:
                    gaps[i] = max(gaps[i], now - max(last, signalled[0]))
                last = now
                counts[i] += 1
                if min(counts) >= args.after:
                    ready.set()
            return "ok"
        except openai.APIError as exc:
            return f"error: {exc}"

    tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    await asyncio.wait_for(ready.wait(), 600)
    on = in_flight(gw)
    victim = max(decodes, key=lambda a: on[a])
    other = next(a for a in decodes if a != victim)
    bytes_before = metric(gw.url + "/metrics", "pdserve_gateway_migration_bytes_sum")
    kinds_before = {k: metric(gw.url + "/metrics", "pdserve_gateway_migrations_total", f'kind="{k}"') for k in KINDS}
    prefill_before = metric(metrics_url(system.workers[other]), "pdserve_worker_tokens_total", 'kind="prefill"')
    proc = system.workers[victim]
    signalled.append(time.monotonic())
    if how == "live":
        os.kill(proc.popen.pid, signal.SIGTERM)
    else:
        os.killpg(proc.popen.pid, signal.SIGKILL)
    await asyncio.to_thread(proc.popen.wait, 120)
    exit_s = time.monotonic() - signalled[0]
    results = await asyncio.gather(*tasks)
    row = {"how": how, "moved": on[victim], "exit_s": exit_s if how == "live" else None,
           "longest_gap_s": max(gaps),
           "kv_bytes": metric(gw.url + "/metrics", "pdserve_gateway_migration_bytes_sum") - bytes_before,
           "prefill_recomputed": metric(metrics_url(system.workers[other]), "pdserve_worker_tokens_total",
                                        'kind="prefill"') - prefill_before,
           "errors": sum(r != "ok" for r in results),
           **{k: metric(gw.url + "/metrics", "pdserve_gateway_migrations_total", f'kind="{k}"') - kinds_before[k]
              for k in KINDS}}
    proc.start()
    proc.wait_healthy(300)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            w["healthy"] for w in requests.get(gw.url + "/get_server_info", timeout=30).json()["workers"]):
        await asyncio.sleep(0.2)
    return row


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--after", type=int, default=48)
    parser.add_argument("--model-path", default=None)
    args = parser.parse_args()
    from pdserve.shared.model_files import resolve_model_path

    model = str(args.model_path or resolve_model_path(None, quiet=True))
    system = System()
    try:
        prefill, paddr = start_worker("prefill", model, "--transfer-backend", "tcp")
        decodes = [start_worker("decode", model, "--transfer-backend", "tcp", "--prefill", paddr,
                                "--max-running-requests", str(args.streams)) for _ in range(2)]
        system.workers.update({paddr: prefill, **{a: p for p, a in decodes}})
        gw = start_gateway(model, "--prefill", paddr, *[f for _, a in decodes for f in ("--decode", a)])
        system.gateways.append(gw)
        for proc in system.workers.values():
            proc.wait_healthy(300)
        gw.proc.wait_healthy(120)
        time.sleep(2)  # the gateway's next health round sees every worker
        rows = [await one_round(system, gw, [a for _, a in decodes], how, args) for how in ("live", "recompute")]
    finally:
        system.stop()
    print(f"{args.streams} streams of {args.tokens} tokens, the busier decode worker leaving after {args.after} "
          f"tokens each ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    print(f"{'how':<10} {'moved':>5} {'exit s':>7} {'longest gap s':>14} {'KV MiB moved':>13} "
          f"{'prefill recomputed':>19} {'errors':>6} {'went live':>9} {'recomputed':>10}")
    for r in rows:
        exit_s = f"{r['exit_s']:.2f}" if r["exit_s"] is not None else "-"
        print(f"{r['how']:<10} {r['moved']:>5} {exit_s:>7} {r['longest_gap_s']:>14.2f} "
              f"{r['kv_bytes'] / 2**20:>13.1f} {r['prefill_recomputed']:>19.0f} {r['errors']:>6} {r['live']:>9.0f} "
              f"{r['recompute']:>10.0f}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
