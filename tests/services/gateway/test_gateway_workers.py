"""`pdserve gateway --gateway-workers 2`: two gateway processes on one port, in front of a real colocated worker
(LoRA enabled) and a real redis-server; then the processes' lifecycle, and the pure logic beneath.

Every request goes on a connection of its own (a new client), so the kernel spreads them over the processes.
Each process's log lines carry its pid (`pdserve.access[PID]: POST /v1/chat/completions 200 ...`), which is how
the tests, like an operator, tell which process answered.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parents[1] / "jobs"))

from harness import Gateway, start_gateway  # noqa: E402
from jobs_harness import RedisServer  # noqa: E402
from procs import free_port, start_worker  # noqa: E402

from pdserve.proto import worker_pb2 as pb  # noqa: E402
from pdserve.services.gateway import cli  # noqa: E402
from pdserve.services.gateway.workers.backend import Backend, BackendSettings  # noqa: E402
from pdserve.services.gateway.errors import Busy  # noqa: E402
from pdserve.services.gateway.metrics import GatewayMetrics  # noqa: E402
from pdserve.services.gateway.workers.router import Router  # noqa: E402
from pdserve.services.gateway.workers.pool import Worker, WorkerPool  # noqa: E402

MAX_RUNNING = 4  # the worker's --max-running-requests
MAX_QUEUED = 2  # the gateway's --max-queued-requests: each of the two processes admits (4 + 2) / 2
ACCESS = re.compile(r"pdserve\.access\[(\d+)\]: (\S+) (\S+) (\d+)")
STARTED = re.compile(r"gateway: 2 processes \(pids (\d+), (\d+)\)")
CHAT = "/v1/chat/completions"
TRIES = 40  # requests until both processes have answered: each lands on one of them by chance


@dataclass
class Deployment:
    gateway: Gateway
    adapters: dict[str, Path]
    worker: str  # its address


def wait_both_listening(gw: Gateway, timeout: float = 120) -> Gateway:
    deadline = time.monotonic() + timeout
    while gw.proc.log_path.read_text().count(" listening on http://") < 2:
        assert gw.proc.alive() and time.monotonic() < deadline, gw.proc.tail()
        time.sleep(0.2)
    return gw


@pytest.fixture(scope="module")
def deployment(default_model_dir, default_model_adapters, tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    worker, address = start_worker("colocated", str(default_model_dir), "--max-running-requests", str(MAX_RUNNING),
                                   "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all")
    gw = start_gateway(default_model_dir, "--worker", address, "--gateway-workers", "2", "--redis-url", redis.url(),
                       "--max-queued-requests", str(MAX_QUEUED),
                       # a name of its own: a request naming an unloaded adapter is then refused, where a gateway
                       # with no name serves any model name with its model (as SGLang)
                       "--served-model-name", "smollm2")
    try:
        worker.wait_healthy(180)
        gw.proc.wait_healthy(120)
        yield Deployment(wait_both_listening(gw), default_model_adapters, address)
    finally:
        gw.proc.stop()
        worker.stop()
        redis.stop()


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key="unused", max_retries=0)


def chat(gw: Gateway, model: str = "default", **kw):
    with client(gw) as c:  # a connection of its own
        return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}],
                                         max_tokens=4, temperature=0, **kw)


def access(gw: Gateway) -> list[tuple[int, str, str, int]]:
    """(pid, method, path, status) of every access line so far."""
    return [(int(m[1]), m[2], m[3], int(m[4])) for m in ACCESS.finditer(gw.proc.log_path.read_text())]


def until_both_answer(gw: Gateway, send, path: str, at_least: int = 4) -> list:
    """`send()` on new connections until both processes have answered `path` twice (and `at_least` replies
    came); the replies."""
    before, replies = len(access(gw)), []
    for _ in range(TRIES):
        replies.append(send())
        pids = [pid for pid, _, p, _ in access(gw)[before:] if p == path]
        if len(set(pids)) == 2 and min(pids.count(p) for p in set(pids)) >= 2 and len(replies) >= at_least:
            return replies
    raise AssertionError(f"{TRIES} requests, all answered by one process: {access(gw)[before:]}")


def metric(gw: Gateway, name: str, labels: dict | None = None) -> float:
    text = requests.get(gw.url + "/metrics", timeout=10).text  # a new connection: either process answers
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and (labels is None or s.labels == labels))


# ---------------------------------------------------------------- serving
def test_requests_spread_over_both_processes_and_all_succeed(deployment):
    gw = deployment.gateway
    before = len(access(gw))
    replies = until_both_answer(gw, lambda: chat(gw), CHAT, at_least=16)
    assert all(r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens for r in replies)
    assert [status for _, _, path, status in access(gw)[before:] if path == CHAT] == [200] * len(replies)


def test_metrics_from_either_process_count_every_process_requests(deployment):
    gw = deployment.gateway
    ok = {"route": CHAT, "status": "200"}
    base = {metric(gw, "pdserve_gateway_requests_total", ok) for _ in range(6)}
    assert len(base) == 1  # whichever process answered the scrape
    made = len(until_both_answer(gw, lambda: chat(gw), CHAT))
    totals = {metric(gw, "pdserve_gateway_requests_total", ok) for _ in range(12)}
    assert totals == {base.pop() + made}
    assert {metric(gw, "pdserve_gateway_running_requests") for _ in range(4)} == {0}


def test_the_queue_limit_holds_for_the_gateway_as_a_whole(deployment):
    gw, count = deployment.gateway, 16
    clients = [client(gw) for _ in range(count)]
    start = threading.Barrier(count)

    def ask(c: openai.OpenAI) -> int:
        start.wait()
        try:
            c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Count to 100"}],
                                      max_tokens=64, extra_body={"ignore_eos": True})
            return 200
        except openai.RateLimitError:
            return 429
        finally:
            c.close()

    with ThreadPoolExecutor(count) as pool:
        statuses = list(pool.map(ask, clients))
    # Each process admits 3 (its half of 4 running + 2 queued): 6 at most in all, 3 at least (one process's).
    assert (MAX_RUNNING + MAX_QUEUED) // 2 <= statuses.count(200) <= MAX_RUNNING + MAX_QUEUED, statuses
    assert statuses.count(429) == count - statuses.count(200)


def test_an_adapter_loaded_through_one_process_serves_through_both(deployment):
    gw = deployment.gateway
    path = str(deployment.adapters["terse"])
    r = requests.post(gw.url + "/load_lora_adapter", json={"lora_name": "terse", "lora_path": path},
                      headers=gw.admin_headers(), timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    replies = until_both_answer(gw, lambda: chat(gw, model="terse"), CHAT)  # the other process asks the worker
    assert all(reply.choices[0].message.content is not None for reply in replies)
    assert all("terse" in {m.id for m in client(gw).models.list()} for _ in range(4))

    r = requests.post(gw.url + "/unload_lora_adapter", json={"lora_name": "terse"}, headers=gw.admin_headers(),
                      timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text

    def refused() -> int:
        with pytest.raises(openai.APIStatusError, match="terse") as error:
            chat(gw, model="terse")
        return error.value.status_code

    # The process that unloaded it knows no such model; the other one's request the worker refuses: 400 both.
    assert set(until_both_answer(gw, refused, CHAT)) == {400}
    assert not any("terse" in {m.id for m in client(gw).models.list()} for _ in range(4))


def test_a_stored_response_is_found_through_both_processes(deployment):
    gw = deployment.gateway
    with client(gw) as c:
        stored = c.responses.create(model="default", input="Say hi", max_output_tokens=4)

    def retrieve():
        with client(gw) as c:
            return c.responses.retrieve(stored.id)

    assert {r.id for r in until_both_answer(gw, retrieve, f"/v1/responses/{stored.id}")} == {stored.id}


def test_abort_request_through_either_process_ends_the_request_where_it_runs(deployment):
    gw = deployment.gateway

    def start_then_abort() -> list:
        rid = f"long-{time.monotonic_ns()}"
        with requests.post(gw.url + "/generate", stream=True, timeout=60, json={
                "text": "Count", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith(b"data: ")  # it runs
            r = requests.post(gw.url + "/abort_request", json={"rid": rid}, headers=gw.admin_headers(), timeout=30)
            assert r.status_code == 200 and r.json()["aborted"] == [rid], r.text
            last = [line for line in lines if line.startswith(b"data: {")][-1]
        return last

    # Each stream and each abort land on either process: both answer aborts, for their own streams or not.
    ends = until_both_answer(gw, start_then_abort, "/abort_request")
    assert all(b'"type":"abort"' in end.replace(b" ", b"") for end in ends), ends


def test_abort_request_through_another_replica_ends_the_request(deployment, default_model_dir):
    # Helm's replicaCount > 1: gateways that share nothing but the workers. The workers find the request.
    replica = start_gateway(default_model_dir, "--worker", deployment.worker)
    gw = deployment.gateway
    try:
        replica.proc.wait_healthy(60)
        rid = f"long-{time.monotonic_ns()}"
        with requests.post(gw.url + "/generate", stream=True, timeout=60, json={
                "text": "Count", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith(b"data: ")  # it runs, sent by the other gateway
            r = requests.post(replica.url + "/abort_request", json={"rid": rid}, headers=replica.admin_headers(),
                              timeout=30)
            assert r.status_code == 200 and r.json()["aborted"] == [rid], r.text
            last = [line for line in lines if line.startswith(b"data: {")][-1]
        assert b'"type":"abort"' in last.replace(b" ", b""), last
        r = requests.post(replica.url + "/abort_request", json={"rid": rid}, headers=replica.admin_headers(),
                          timeout=30)
        assert r.status_code == 200 and r.json()["aborted"] == []  # nothing runs under it any more
    finally:
        replica.proc.stop()


def test_the_status_page_counts_a_request_running_in_either_process(deployment):
    gw = deployment.gateway

    def running() -> int:
        r = requests.get(gw.url + "/status.json", headers=gw.admin_headers(), timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["requests"]["running"]

    rid = f"long-{time.monotonic_ns()}"
    with requests.post(gw.url + "/generate", stream=True, timeout=60, json={
            "text": "Count", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith(b"data: ")  # it runs in one of the processes
        try:
            # Until both processes have answered: the one without the stream counts it too.
            assert set(until_both_answer(gw, running, "/status.json")) == {1}
        finally:
            requests.post(gw.url + "/abort_request", json={"rid": rid}, headers=gw.admin_headers(), timeout=30)
        assert b"abort" in [line for line in lines if line.startswith(b"data: {")][-1]  # ended
    deadline = time.monotonic() + 10  # the process that ran it counts it until its handler has returned
    while (counts := {running() for _ in range(6)}) != {0} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts == {0}


def test_a_weight_update_holds_every_process_and_all_serve_the_new_weights(tiny_models):
    worker, address = start_worker("colocated", str(tiny_models["old"]), "--dtype", "float32")
    gw = start_gateway(tiny_models["old"], "--worker", address, "--gateway-workers", "2",
                       "--redis-url", "redis://127.0.0.1:1/0")
    try:
        worker.wait_healthy(120)
        gw.proc.wait_healthy(60)
        wait_both_listening(gw)
        old, new = greedy(gw, 12), None
        with ThreadPoolExecutor(16) as pool:
            long = pool.submit(greedy, gw, 480)
            time.sleep(0.2)  # it runs
            update = pool.submit(requests.post, gw.url + "/update_weights_from_disk", headers=gw.admin_headers(),
                                 json={"model_path": str(tiny_models["new"])}, timeout=120)
            while "another process of the gateway updates the weights" not in gw.proc.log_path.read_text():
                assert not update.done(), update.result().text
                time.sleep(0.01)
            before = len(access(gw))
            held = [pool.submit(greedy, gw, 12) for _ in range(12)]  # at both doors, the long one still running
            assert long.result()[:12] == old
            assert update.result().json()["success"], update.result().text
            new = {tuple(h.result()) for h in held}
        assert len(new) == 1 and new != {tuple(old)}  # all on the new weights, whichever process took them
        assert len({pid for pid, _, path, _ in access(gw)[before:] if path == "/generate"}) == 2
        infos = until_both_answer(gw, lambda: requests.get(gw.url + "/get_model_info", timeout=10).json(),
                                  "/get_model_info")
        assert {info["model_path"] for info in infos} == {str(tiny_models["new"])}
    finally:
        gw.proc.stop()
        worker.stop()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from fixtures import make_tiny_model

    root = tmp_path_factory.mktemp("weights")
    return {"old": make_tiny_model("qwen3", root / "old", seed=0), "new": make_tiny_model("qwen3", root / "new", seed=1)}


def greedy(gw: Gateway, tokens: int) -> list[int]:
    r = requests.post(gw.url + "/generate", timeout=120, json={
        "input_ids": [5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66, 12, 13, 14],
        "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


# ---------------------------------------------------------------- lifecycle (no worker needed)
def start_alone(model_dir) -> Gateway:
    """Two processes in front of a worker that is not there: they listen, and answer /health with 503."""
    return wait_both_listening(start_gateway(model_dir, "--worker", f"127.0.0.1:{free_port()}",
                                             "--gateway-workers", "2", "--redis-url", "redis://127.0.0.1:1/0"))


def children(gw: Gateway) -> list[int]:
    return [int(pid) for pid in STARTED.search(gw.proc.log_path.read_text()).groups()]


def group(pgid: int) -> list[int]:
    """The processes of a process group that still run (a zombie has ended)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            state, _, group_id = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group_id) == pgid and state != "Z":
            found.append(int(entry.name))
    return found


def wait_gone(pgid: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group(pgid), f"processes left behind: {group(pgid)}"


def test_sigterm_to_the_parent_stops_every_process_and_leaves_nothing(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the parent makes the processes' private directory
    gw = start_alone(default_model_dir)
    try:
        parent, pids = gw.proc.popen.pid, children(gw)
        assert set(pids) <= set(group(parent))
        assert [d.name.startswith("pdserve-gateway-") for d in tmp_path.iterdir()] == [True]
        os.kill(parent, signal.SIGTERM)  # the parent alone, as an orchestrator does
        assert gw.proc.popen.wait(30) == 0, gw.proc.tail()
        wait_gone(parent)
        assert not list(tmp_path.iterdir())
    finally:
        gw.proc.kill()


def test_a_process_that_dies_stops_the_gateway_with_an_error(default_model_dir):
    gw = start_alone(default_model_dir)
    try:
        victim, survivor = children(gw)
        os.kill(victim, signal.SIGKILL)
        assert gw.proc.popen.wait(30) != 0
        log = gw.proc.log_path.read_text()
        assert f"(pid {victim}) exited with status -9: stopping the others" in log
        wait_gone(gw.proc.popen.pid)
        assert survivor not in group(gw.proc.popen.pid)
    finally:
        gw.proc.kill()


def test_the_processes_stop_when_their_parent_is_killed_and_leave_nothing(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the parent makes the processes' private directory
    gw = start_alone(default_model_dir)
    try:
        assert [d.name.startswith("pdserve-gateway-") for d in tmp_path.iterdir()] == [True]
        os.kill(gw.proc.popen.pid, signal.SIGKILL)
        wait_gone(gw.proc.popen.pid)
        assert "parent process" in gw.proc.log_path.read_text() and "is gone: stopping" in gw.proc.tail()
        assert not list(tmp_path.iterdir())  # the last process out removed the directory the parent could not
    finally:
        gw.proc.kill()


def test_without_redis_the_first_process_keeps_the_stored_responses_of_both(deployment, default_model_dir,
                                                                             monkeypatch):
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    gw = wait_both_listening(start_gateway(default_model_dir, "--worker", deployment.worker, "--gateway-workers", "2"))
    try:
        gw.proc.wait_healthy(60)
        with client(gw) as c:
            first = c.responses.create(model="default", input="Say hi", max_output_tokens=4)

        def follow_up():  # each on a new connection: either process answers, and each finds `first`
            with client(gw) as c:
                return c.responses.create(model="default", input="And again", max_output_tokens=4,
                                          previous_response_id=first.id)

        replies = until_both_answer(gw, follow_up, "/v1/responses")
        assert all(r.status != "failed" and r.usage.input_tokens > first.usage.input_tokens for r in replies)
        with client(gw) as c:
            c.responses.delete(first.id)
        with client(gw) as c, pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
    finally:
        gw.proc.stop()


# ---------------------------------------------------------------- pure logic
def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser, "gateway")
    return parser.parse_args(["--worker", "127.0.0.1:1", *flags])


def test_flags_are_checked_before_anything_starts(monkeypatch):
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    assert cli.check(parse()) is None
    assert "--gateway-workers must be >= 1" in cli.check(parse("--gateway-workers", "0"))
    assert cli.check(parse("--gateway-workers", "2")) is None


def pool_of(addresses: list[str], max_running: int = 8) -> WorkerPool:
    pool = WorkerPool({"colocated": addresses})
    for address in addresses:
        pool.workers[address] = Worker(address, "colocated", None, None, healthy=True,
                                       info=pb.InfoReply(compat=pb.Compat(page_size=16), max_running_requests=max_running),
                                       load=pb.LoadReply(free_pages=100, total_pages=100))
    return pool


@pytest.mark.parametrize("processes, max_running, queued, admitted", [
    (1, 8, 2, 10), (2, 8, 2, 5), (3, 8, 2, 3), (4, 0, 0, 1)])
async def test_each_process_admits_its_share_and_at_least_one(processes, max_running, queued, admitted):
    backend = Backend(None, pool_of(["10.0.0.1:1"], max_running), None, GatewayMetrics(),
                      BackendSettings(max_queued_requests=queued, processes=processes))
    async with AsyncExitStack() as places:
        for _ in range(admitted):
            await places.enter_async_context(backend.encoding())
        with pytest.raises(Busy) as refused:
            await places.enter_async_context(backend.encoding())
    assert refused.value.status == 429 and backend.in_flight == 0


def test_routers_that_share_nothing_send_a_conversation_to_the_same_worker():
    # Two gateway processes: each its own pool view and prefix tables; the turns of a conversation alternate.
    addresses = [f"10.0.0.{i}:50051" for i in range(4)]
    routers = [Router(pool_of(addresses)), Router(pool_of(addresses))]
    homes = set()
    for conversation in range(40):
        turn = [conversation * 1000 + i for i in range(40)]
        first = routers[0].choose(turn).generate.address
        for k in range(1, 4):
            turn = turn + [7] * 20
            assert routers[k % 2].choose(turn).generate.address == first
        homes.add(first)
    assert len(homes) == len(addresses)  # new conversations still spread over the workers
