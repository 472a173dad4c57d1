"""A prefill or decode worker killed and started again on the same address: the pair heals by itself.

Real prefill, decode and gateway processes on a tiny model, the gateway with its default health checks.
While a worker is down the gateway's /health is not 200 and requests get a prompt OpenAI-style 503; once the
worker is back (nothing else restarted) requests succeed again within seconds.
"""
from __future__ import annotations

import time

import pytest
import requests

from fixtures import make_tiny_model
from procs import Proc, free_port, start_worker

BACK_WITHIN_S = 5.0  # from the restarted worker answering its own /health to a served request
CHAT = {"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    model = str(make_tiny_model("llama", tmp_path_factory.mktemp("recovery") / "llama"))
    flags = ("--model-path", model, "--dtype", "float32", "--transfer-backend", "tcp")
    prefill, paddr = start_worker("prefill", None, *flags)
    decode, daddr = start_worker("decode", None, *flags, "--prefill", paddr)
    port = free_port()
    gateway = Proc("gateway", ["gateway", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
                               "--prefill", paddr, "--decode", daddr],
                   health_url=f"http://127.0.0.1:{port}/health").start({"OMP_NUM_THREADS": "1"})
    procs = {"prefill": prefill, "decode": decode, "gateway": gateway}
    try:
        for proc in procs.values():
            proc.wait_healthy(180)
        yield procs, f"http://127.0.0.1:{port}"
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()


def chat(url: str) -> requests.Response:
    return requests.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)


def wait_health_not_ok(url: str, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = requests.get(f"{url}/health", timeout=5).status_code
        if status != 200:
            return status
        time.sleep(0.1)
    raise AssertionError(f"the gateway still reports healthy {timeout} s after a worker died")


def restart(procs: dict[str, Proc], role: str) -> float:
    """Start `role` again with its own command line (same ports); when it answers its own /health."""
    old = procs[role]
    procs[role] = Proc(old.name, old.args, health_url=old.health_url).start()
    procs[role].wait_healthy(180)
    return time.monotonic()


def wait_served(url: str, since: float) -> float:
    """Seconds from `since` until a chat request succeeds (fails the test past BACK_WITHIN_S)."""
    while True:
        reply = chat(url)
        waited = time.monotonic() - since
        if reply.status_code == 200:
            assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")
            return waited
        assert reply.status_code == 503, reply.text
        assert waited < BACK_WITHIN_S, f"still failing {waited:.1f} s after the worker was back: {reply.text}"
        time.sleep(0.2)


def assert_prompt_503(url: str) -> None:
    started = time.monotonic()
    reply = chat(url)
    assert time.monotonic() - started < 5
    assert reply.status_code == 503
    error = reply.json()
    assert error["object"] == "error" and error["code"] == 503 and error["type"] == "service_unavailable_error"
    assert "worker" in error["message"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_killed_and_started_again_serves_within_seconds(system, role):
    procs, url = system
    assert chat(url).status_code == 200
    survivors = {name: p.popen.pid for name, p in procs.items() if name != role}

    procs[role].kill()
    assert wait_health_not_ok(url) == 503
    assert_prompt_503(url)

    back = restart(procs, role)
    assert wait_served(url, back) < BACK_WITHIN_S
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    assert [chat(url).status_code for _ in range(3)] == [200] * 3
    # Nothing else was restarted.
    assert {name: p.popen.pid for name, p in procs.items() if name != role} == survivors
    assert all(p.alive() for p in procs.values())
