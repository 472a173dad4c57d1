"""Live role switch: how long a worker takes to change role, idle and under load, and what the clients notice.

    .venv/bin/python benchmarks/bench_role_switch.py [--rounds 5] [--streams 4] [--max-tokens 32]

Starts one prefill and two decode workers of the default model (TCP transfer) and a gateway, real processes on
loopback. Each round switches the second decode worker to prefill and back (`--pause` seconds of serving before each
switch), through POST /workers/switch_role,
first with no load and then while `--streams` clients send greedy /generate requests back to back. Reports each
direction's switch time (median and worst, the seconds the gateway answered with) and the clients' failed
requests (must be 0). Not part of the test suite; tests/services/gateway/test_role_switch.py asserts the same
under a 10 s bound.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "services" / "gateway"))
from harness import System, start_gateway, start_worker  # noqa: E402

from pdserve.shared.model_files import resolve_model_path  # noqa: E402


def switch(gw, url: str, worker_type: str) -> float:
    r = requests.post(gw.url + "/workers/switch_role", json={"url": url, "worker_type": worker_type},
                      headers=gw.admin_headers(), timeout=120)
    r.raise_for_status()
    return r.json()["seconds"]


def load(gw, stop: threading.Event, failures: list, answered: list, max_tokens: int, i: int) -> None:
    while not stop.is_set():
        try:
            r = requests.post(gw.url + "/generate", json={"text": f"Tell me a story, reader {i}.", "sampling_params": {
                "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}, timeout=120)
            (answered if r.status_code == 200 else failures).append(r.status_code)
        except requests.RequestException as exc:
            failures.append(repr(exc))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of serving between two switches")
    args = parser.parse_args()
    model = str(resolve_model_path(None, quiet=True))
    system = System()
    try:
        prefill, paddr = start_worker("prefill", model, "--transfer-backend", "tcp")
        decodes = [start_worker("decode", model, "--transfer-backend", "tcp", "--prefill", paddr) for _ in range(2)]
        for proc, addr in [(prefill, paddr), *decodes]:
            system.workers[addr] = proc
        gw = start_gateway(model, "--prefill", paddr, *(f for _, a in decodes for f in ("--decode", a)))
        system.gateways.append(gw)
        for proc in [prefill, *(p for p, _ in decodes), gw.proc]:
            proc.wait_healthy(300)
        moving = decodes[1][1]
        for loaded in (False, True):
            stop, failures, answered = threading.Event(), [], []
            clients = [threading.Thread(target=load, args=(gw, stop, failures, answered, args.max_tokens, i))
                       for i in range(args.streams if loaded else 0)]
            for t in clients:
                t.start()
            times = {"decode->prefill": [], "prefill->decode": []}
            for _ in range(args.rounds):
                for direction, target in (("decode->prefill", "prefill"), ("prefill->decode", "decode")):
                    time.sleep(args.pause)  # the worker serves in its role meanwhile
                    times[direction].append(switch(gw, moving, target))
            stop.set()
            for t in clients:
                t.join(120)
            what = f"{args.streams} streams of {args.max_tokens} tokens" if loaded else "idle"
            for direction, seconds in times.items():
                print(f"{what:>24} {direction}: median {statistics.median(seconds):.3f} s, worst {max(seconds):.3f} s "
                      f"({len(seconds)} switches)")
            if loaded:
                print(f"{'':>24} requests answered {len(answered)}, failed {len(failures)} {failures[:3]}")
        print(f"load average {os.getloadavg()[0]:.2f}")
        return 0
    finally:
        system.stop()


if __name__ == "__main__":
    sys.exit(main())
