"""Real processes for the hostile-request suite: one colocated worker (4 requests at once, one thread) behind two
gateways, reusing the gateway tests' harness.

- `plain`: the default limits, as users run it.
- `strict`: short timeouts (1 s for a request head, a body and a stalled stream), no queue beyond the 4 places
  the worker runs (--max-queued-requests 0), and --max-request-tokens 4096, so that every bound is reached in a
  second with small requests.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "services" / "gateway"))

from harness import Gateway, System, start_gateway, start_worker  # noqa: E402

MAX_RUNNING = 4
STRICT = ("--header-timeout", "1", "--body-timeout", "1", "--stream-write-timeout", "1",
          "--max-queued-requests", "0", "--max-request-tokens", "4096")


@dataclass
class Hostile:
    worker: str  # gRPC address
    worker_pid: int
    plain: Gateway
    strict: Gateway


@pytest.fixture(scope="session")
def hostile(default_model_dir):
    system = System()
    try:
        proc, addr = start_worker("colocated", str(default_model_dir), "--max-running-requests", str(MAX_RUNNING),
                                  threads=1)
        system.workers[addr] = proc
        plain = start_gateway(default_model_dir, "--worker", addr)
        strict = start_gateway(default_model_dir, "--worker", addr, *STRICT)
        system.gateways += [plain, strict]
        proc.wait_healthy(180)
        for gw in (plain, strict):
            gw.proc.wait_healthy(60)
        yield Hostile(addr, proc.popen.pid, plain, strict)
    finally:
        system.stop()
