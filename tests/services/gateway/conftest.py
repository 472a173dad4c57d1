"""Shared real systems for the gateway tests: one colocated worker behind three gateways.

- `open`: no API key, the plain configuration users start with.
- `secured`: --api-key, --max-queued-requests 0, --enable-cache-report, --reasoning-parser deepseek-r1.
- `dead`: pointed at a port where no worker listens.
The worker runs at most 4 requests at once (so the queue limit is reachable) on one thread.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import API_KEY, Gateway, System, free_port, start_gateway, start_worker, wait_listening  # noqa: E402

MAX_RUNNING = 4


@dataclass
class Colocated:
    worker: str  # gRPC address
    open: Gateway
    secured: Gateway
    dead: Gateway
    system: System


@pytest.fixture(scope="session")
def colocated(default_model_dir):
    system = System()
    try:
        proc, addr = start_worker("colocated", str(default_model_dir), "--max-running-requests", str(MAX_RUNNING),
                                  threads=1)
        system.workers[addr] = proc
        open_gw = start_gateway(default_model_dir, "--worker", addr)
        secured = start_gateway(default_model_dir, "--worker", addr, "--api-key", API_KEY,
                                "--max-queued-requests", "0", "--enable-cache-report",
                                "--reasoning-parser", "deepseek-r1")
        dead = start_gateway(default_model_dir, "--worker", f"127.0.0.1:{free_port()}")
        system.gateways += [open_gw, secured, dead]
        proc.wait_healthy(180)
        for gw in (open_gw, secured):
            gw.proc.wait_healthy(60)
        wait_listening(dead)
        yield Colocated(addr, open_gw, secured, dead, system)
    finally:
        system.stop()
