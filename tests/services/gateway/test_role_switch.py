"""A live role switch through the gateway's admin API: one prefill and two decode workers of the default model.

What an operator must see: a decode worker switched to prefill, back to decode and to prefill again under steady
load answers 200 within seconds each time and no request fails; a long prompt it computed as a prefill worker is
found in its cache by the router once it decodes again; every switch that cannot be done is refused with its
reason; a worker that dies mid-switch is taken out and the call answers an error instead of hanging.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import requests

from harness import ADMIN_KEY, System, start_gateway, start_worker, worker_call
from procs import children
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stack(default_model_dir):
    system = System()
    try:
        prefill, paddr = start_worker("prefill", str(default_model_dir), "--transfer-backend", "tcp")
        decodes = [start_worker("decode", str(default_model_dir), "--transfer-backend", "tcp", "--prefill", paddr)
                   for _ in range(2)]
        for proc, addr in [(prefill, paddr), *decodes]:
            system.workers[addr] = proc
        targets = ["--prefill", paddr, *(flag for _, a in decodes for flag in ("--decode", a))]
        gw = start_gateway(default_model_dir, *targets, "--enable-cache-report")
        system.gateways.append(gw)
        for proc in [prefill, *(p for p, _ in decodes), gw.proc]:
            proc.wait_healthy(240)
        wait_for(lambda: all(w["is_healthy"] for w in workers(gw).values()), 60)
        yield system, gw, paddr, [a for _, a in decodes]
    finally:
        system.stop()


def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def workers(gw) -> dict[str, dict]:
    r = requests.get(gw.url + "/workers", headers=gw.admin_headers(), timeout=30)
    assert r.status_code == 200, r.text
    return {w["url"]: w for w in r.json()["workers"]}


def switch(gw, url: str, worker_type: str, timeout: float = 90) -> requests.Response:
    return requests.post(gw.url + "/workers/switch_role", json={"url": url, "worker_type": worker_type},
                         headers=gw.admin_headers(), timeout=timeout)


def generate(gw, text: str, max_new_tokens: int = 8) -> dict:
    r = requests.post(gw.url + "/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


class Load:
    """Steady background requests, two at a time, until stopped; every failure kept."""

    def __init__(self, gw) -> None:
        self.gw, self.done, self.failures, self.answered = gw, threading.Event(), [], 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def _run(self, i: int) -> None:
        while not self.done.is_set():
            try:
                r = requests.post(self.gw.url + "/generate", json={"text": f"Count to ten, client {i}:",
                                  "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True}}, timeout=60)
                if r.status_code != 200:
                    self.failures.append(r.text)
                else:
                    self.answered += 1
            except requests.RequestException as exc:
                self.failures.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self.threads:
            t.join(120)


def test_workers_lists_every_worker_with_its_type_and_load(stack):
    system, gw, paddr, daddrs = stack
    listed = workers(gw)
    assert {u: w["worker_type"] for u, w in listed.items()} == {paddr: "prefill", **{a: "decode" for a in daddrs}}
    assert all(isinstance(w["load"], int) and w["is_healthy"] for w in listed.values())
    assert requests.get(gw.url + "/workers", timeout=30).status_code == 401  # the admin key is needed


def test_every_refusal_is_named(stack):
    system, gw, paddr, daddrs = stack
    cases = [({"url": paddr, "worker_type": "decode"}, 400, "last_of_role"),
             ({"url": daddrs[0], "worker_type": "decode"}, 400, "same_role"),
             ({"url": daddrs[0], "worker_type": "regular"}, 400, "mixed_deployment"),
             ({"url": daddrs[0], "worker_type": "encoder"}, 400, "unknown_role"),
             ({"url": "127.0.0.1:1", "worker_type": "prefill"}, 404, "unknown_worker")]
    for body, status, reason in cases:
        r = requests.post(gw.url + "/workers/switch_role", json=body, headers=gw.admin_headers(), timeout=30)
        assert r.status_code == status and f"reason: {reason}" in r.json()["message"], (body, r.text)
        assert r.json()["object"] == "error"
    assert requests.post(gw.url + "/workers/switch_role", json=cases[0][0], timeout=30).status_code == 401
    # The worker refuses on its own too: to a gateway that does not check first, or a second caller.
    with grpc.insecure_channel(daddrs[0]) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerStub(ch).SwitchRole(pb.SwitchRoleRequest(role="decode"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().startswith("same_role:")
    assert all(w["worker_type"] == t for w, t in zip((workers(gw)[a] for a in daddrs), ("decode", "decode")))


def test_a_decode_worker_switches_to_prefill_and_back_under_load_keeping_its_cache(stack):
    system, gw, paddr, daddrs = stack
    moving = daddrs[1]
    words = " ".join(f"item{i}" for i in range(520))  # about 1,100 tokens
    with Load(gw) as load:
        time.sleep(1.0)
        r = switch(gw, moving, "prefill")
        assert r.status_code == 200 and r.json()["seconds"] < 10, r.text
        assert workers(gw)[moving]["worker_type"] == "prefill"
        # A long prompt computed on the switched worker (the router picks a prefill worker per prompt: try a few).
        for attempt in range(8):
            long_prompt = f"Variant {attempt}. Remember these words: {words}. Which word came first?"
            before = worker_call(moving, "Load").cached_pages
            generate(gw, long_prompt, 4)
            if worker_call(moving, "Load").cached_pages - before >= 60:
                break
        else:
            pytest.fail("no long prompt was computed on the switched worker")
        r = switch(gw, moving, "decode")
        assert r.status_code == 200 and r.json()["seconds"] < 10, r.text
        # The other prefill worker forgets it: only the switched worker's own cache can serve it now.
        with grpc.insecure_channel(paddr) as ch:
            pb_grpc.WorkerStub(ch).FlushCache(pb.FlushRequest(), timeout=30)
        out = generate(gw, long_prompt, 4)
        assert out["meta_info"]["cached_tokens"] >= 1000, out["meta_info"]
        r = switch(gw, moving, "prefill")
        assert r.status_code == 200 and r.json()["seconds"] < 10, r.text
        time.sleep(1.0)
    assert load.failures == [] and load.answered > 0, load.failures[:3]
    r = switch(gw, moving, "decode")  # as the module started, for the tests after this one
    assert r.status_code == 200, r.text


def test_a_switch_while_requests_run_in_each_direction(stack):
    system, gw, paddr, daddrs = stack
    moving = daddrs[1]
    for target in ("prefill", "decode"):
        results = []
        threads = [threading.Thread(target=lambda: results.append(generate(gw, "Tell me a story.", 48)))
                   for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        r = switch(gw, moving, target)
        for t in threads:
            t.join(120)
        assert r.status_code == 200, r.text
        assert len(results) == 4 and all(o["meta_info"]["completion_tokens"] == 48 for o in results), results
        assert workers(gw)[moving]["worker_type"] == target


def test_two_switches_of_one_worker_at_once_one_is_refused(stack):
    system, gw, paddr, daddrs = stack
    moving, answers = daddrs[1], []
    threads = [threading.Thread(target=lambda: answers.append(switch(gw, moving, "prefill"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in answers)
    assert codes in ([200, 409], [200, 400]), [r.text for r in answers]
    refused = next(r for r in answers if r.status_code != 200)
    assert "switch_in_progress" in refused.text or "same_role" in refused.text
    assert switch(gw, moving, "decode").status_code == 200


def test_pdserve_debug_lists_and_switches(stack):
    system, gw, paddr, daddrs = stack
    moving = daddrs[1]

    def debug(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdserve", "debug", *args, "--gateway", gw.url],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PDSERVE_ADMIN_API_KEY": ADMIN_KEY})

    listed = debug("workers")
    assert listed.returncode == 0 and f"{moving}" in listed.stdout and "decode" in listed.stdout, listed.stderr
    to_prefill = debug("switch-role", moving, "prefill")
    assert to_prefill.returncode == 0 and f"{moving} is a prefill worker now" in to_prefill.stdout, to_prefill.stderr
    assert "prefill" in next(line for line in debug("workers").stdout.splitlines() if line.startswith(moving))
    back = debug("switch-role", moving, "decode")
    assert back.returncode == 0 and f"{moving} is a decode worker now" in back.stdout, back.stderr
    last = debug("switch-role", paddr, "decode")
    assert last.returncode == 1 and "last_of_role" in last.stderr, last.stderr


def test_a_worker_that_dies_mid_switch_is_taken_out_and_the_call_answers(stack):
    system, gw, paddr, daddrs = stack
    moving = daddrs[1]
    proc = system.workers[moving]
    engine, = children(proc.popen.pid)
    os.kill(engine, signal.SIGSTOP)  # its engine takes no step: the switch is held under way until the kill
    answers = []
    caller = threading.Thread(target=lambda: answers.append(switch(gw, moving, "prefill", timeout=60)))
    started = time.monotonic()
    caller.start()
    time.sleep(1.0)
    assert not answers and workers(gw)[moving]["switching"]
    proc.kill()
    caller.join(60)
    assert answers and answers[0].status_code == 503 and "worker_lost" in answers[0].text, answers
    assert time.monotonic() - started < 30
    assert not workers(gw)[moving]["is_healthy"]  # out of rotation by the time the call answered
    generate(gw, "Still serving?", 4)  # the others serve on
