"""The SLO planner in a real gateway over real workers of the default model (one prefill, two decode), under a
TTFT target no request can meet (1 ms): in dry run it decides a decode worker should become a prefill worker,
says so (log, status page, metrics) and switches nothing; for real, it switches one worker, once (the floor of
one decode worker stops a second), and no request fails."""
from __future__ import annotations

import re
import threading
import time

import pytest
import requests

from harness import System, start_gateway, start_worker

pytestmark = pytest.mark.slow
TIMEOUT = 60
PLANNER = ("--planner", "slo", "--ttft-slo-ms", "1", "--itl-slo-ms", "60000", "--planner-interval-s", "0.5",
           "--planner-window-s", "4", "--planner-dwell-s", "600")


@pytest.fixture(scope="module")
def workers():
    system = System()
    try:
        prefill, prefill_addr = start_worker("prefill")
        system.workers[prefill_addr] = prefill
        for _ in range(2):
            decode, addr = start_worker("decode", None, "--prefill", prefill_addr)
            system.workers[addr] = decode
        for proc in system.workers.values():
            proc.wait_healthy(180)
        yield system, prefill_addr, [a for a in system.workers if a != prefill_addr]
    finally:
        system.stop()


def gateway(model_dir, system, prefill_addr, decode_addrs, *flags):
    gw = start_gateway(model_dir, "--prefill", prefill_addr, *[f for a in decode_addrs for f in ("--decode", a)],
                       *flags)
    system.gateways.append(gw)
    gw.proc.wait_healthy(120)
    return gw


class Load:
    """Short generations one after the other until stopped; every answer's status kept."""

    def __init__(self, gw) -> None:
        self.gw, self.statuses, self._stop = gw, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = requests.post(self.gw.url + "/generate", timeout=TIMEOUT, json={
                    "text": "Name three rivers of Europe.",
                    "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}})
                self.statuses.append(r.status_code if r.status_code != 200 or r.json()["text"] else "empty")
            except requests.RequestException as exc:
                self.statuses.append(repr(exc))

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(TIMEOUT)
        return self.statuses


def planner_status(gw) -> dict:
    r = requests.get(gw.url + "/status.json", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(gw, accept, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = planner_status(gw)
        if accept(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def metric(gw, name: str) -> dict[str, float]:
    text = requests.get(gw.url + "/metrics", timeout=TIMEOUT).text
    return {labels: float(v) for labels, v in re.findall(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M)}


def switched(decision: dict) -> bool:
    return (decision["outcome"] or "").startswith("switched in")


def switches(status: dict) -> list[dict]:
    return [d for d in status["planner"]["decisions"] if d["action"] == "switch"]


def test_dry_run_decides_under_a_missed_ttft_and_switches_nothing(default_model_dir, workers):
    system, prefill_addr, decode_addrs = workers
    gw = gateway(default_model_dir, system, prefill_addr, decode_addrs, *PLANNER, "--planner-dry-run")
    load = Load(gw)
    try:
        status = wait_for(gw, lambda s: switches(s))
    finally:
        statuses = load.stop()
    decided = switches(status)
    assert decided, status["planner"]
    d = decided[0]
    assert (d["from"], d["to"], d["reason"]) == ("decode", "prefill", "ttft")
    assert len(d["addresses"]) == 1 and d["addresses"][0] in decode_addrs  # the floor: one decode worker stays
    assert d["outcome"] == "dry run: not switched"
    assert status["planner"]["dry_run"] and status["planner"]["desired"]["prefill"] > 1
    assert {role: len(ws) for role, ws in status["workers"].items()} == {"prefill": 1, "decode": 2}
    assert metric(gw, "pdserve_planner_dry_run_switches_total") == {
        'from="decode",reason="ttft",to="prefill"': pytest.approx(len(decided), abs=1)}
    assert metric(gw, "pdserve_planner_role_switches_total") == {}
    assert float(metric(gw, "pdserve_planner_desired_workers")['role="prefill"']) > 1
    assert statuses and set(statuses) == {200}
    gw.proc.stop()
    assert "planner: would switch" in gw.proc.tail(400)


def test_the_planner_switches_one_worker_once_and_no_request_fails(default_model_dir, workers):
    system, prefill_addr, decode_addrs = workers
    gw = gateway(default_model_dir, system, prefill_addr, decode_addrs, *PLANNER)
    load = Load(gw)
    try:
        status = wait_for(gw, lambda s: any(switched(d) for d in switches(s)), timeout=90)
        time.sleep(5)  # long enough for the planner to try a second switch, which the floor must stop
        status = planner_status(gw)
    finally:
        statuses = load.stop()
    # A switch the worker refused (its requests not drained in time on a loaded machine) is tried again after
    # the cooldown; one succeeds, and no second.
    done = [d for d in switches(status) if switched(d)]
    assert len(done) == 1, status["planner"]
    assert {role: len(ws) for role, ws in status["workers"].items()} == {"prefill": 2, "decode": 1}
    assert status["planner"]["decisions"][0]["reason"] == "floor"
    assert metric(gw, "pdserve_planner_role_switches_total") == {'from="decode",reason="ttft",to="prefill"': 1.0}
    assert len(statuses) > 5 and set(statuses) == {200}, statuses
