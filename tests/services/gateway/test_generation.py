"""Generation logic over scripted in-process gRPC workers: stop strings, stop tokens, cancellation, retries.

The workers here are stand-ins that replay token ids, so the gateway's side of the protocol can be checked
exactly (what is shown, what is counted, when the call is cancelled); real workers are in the API tests.
"""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.gateway.workers.backend import Backend, BackendSettings
from pdserve.services.gateway.errors import ApiError, Busy
from pdserve.services.gateway.workers.job import Job
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.workers.router import Router
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers.pool import HealthSettings, WorkerPool
from pdserve.shared.sampling_params import SamplingParams
from harness import ScriptedWorker

EOS = 2


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return ModelTokenizer(default_model_dir)


async def serve(worker: ScriptedWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def make_backend(tok, addresses: list[str], health: HealthSettings = HealthSettings()) -> Backend:
    pool = WorkerPool({"colocated": addresses}, health)
    await pool.start()
    return Backend(tok, pool, Router(pool, "round_robin"), GatewayMetrics(), BackendSettings(stall_timeout_s=5))


def job(tok, stops=(), n=1, max_new=100) -> Job:
    return Job("r1", tok.encode("hello"), SamplingParams(temperature=0.0, max_new_tokens=max_new, n=n), list(stops))


async def test_stop_string_cuts_the_text_cancels_the_worker_and_counts_tokens(tok):
    ids = tok.encode("The answer is 42 🤖.\nUser: and this must never be generated", add_special_tokens=False)
    worker = ScriptedWorker([[t] for t in ids])
    server, addr = await serve(worker)
    backend = await make_backend(tok, [addr])
    try:
        with backend.generation(job(tok, stops=["\nUser:"])) as gen:
            shown, updates = "", []
            async for u in gen.updates():
                updates.append(u)
                shown += u.text
                assert "The answer is 42 🤖.".startswith(shown)  # never a piece of the stop string
        await asyncio.wait_for(worker.ended.wait(), 5)
        assert not worker.completed and worker.sent < len(ids)  # the call was cancelled at the stop string
        assert shown == "The answer is 42 🤖."
        assert (updates[-1].finish_reason, updates[-1].matched_stop) == ("stop", "\nUser:")
        upto = len(tok.encode("The answer is 42 🤖.\nUser:", add_special_tokens=False))
        assert gen.completion_tokens == upto and gen.cached_tokens == 3
    finally:
        await backend.pool.close()
        await server.stop(0)


async def test_stop_token_is_counted_but_never_shown(tok):
    ids = tok.encode("Paris.", add_special_tokens=False)
    worker = ScriptedWorker([[t] for t in ids[:-1]] + [[ids[-1], EOS]], finish="stop", stop_token=EOS)
    server, addr = await serve(worker)
    backend = await make_backend(tok, [addr])
    try:
        with backend.generation(job(tok)) as gen:
            [result] = await gen.collect()
        assert result.text == "Paris."
        assert (result.finish_reason, result.matched_stop) == ("stop", EOS)
        assert result.token_ids == ids + [EOS] and gen.completion_tokens == len(ids) + 1
    finally:
        await backend.pool.close()
        await server.stop(0)


async def test_a_worker_that_comes_up_after_the_gateway_serves_within_a_moment_not_a_check_interval():
    # Gateway processes sharing a port each find the worker on their own; with nothing to serve, none may wait a
    # whole check interval (30 s here) after the worker is up, answering 503 while a sibling already serves.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = WorkerPool({"colocated": [f"127.0.0.1:{port}"]}, HealthSettings(interval_s=30.0))
    await pool.start()
    server = grpc.aio.server()
    try:
        assert not pool.has_healthy_pair()  # nothing listens yet
        pb_grpc.add_WorkerServicer_to_server(ScriptedWorker([[5]]), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        for _ in range(50):
            if pool.has_healthy_pair():
                break
            await asyncio.sleep(0.1)
        assert pool.has_healthy_pair()
    finally:
        await pool.close()
        await server.stop(0)


class CountedHealth(ScriptedWorker):
    def __init__(self) -> None:
        super().__init__([[5]])
        self.health_calls = 0

    async def Health(self, request, context):
        self.health_calls += 1
        await asyncio.sleep(0.05)
        return await super().Health(request, context)


async def test_a_request_finds_a_worker_that_came_up_since_the_last_check_instead_of_a_503(tok):
    # No round would find it for 30 s: the request itself has the workers checked, once for all who wait.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = HealthSettings(interval_s=30.0, unserved_interval_s=30.0)
    backend = await make_backend(tok, [f"127.0.0.1:{port}"], settings)
    server, worker = grpc.aio.server(), CountedHealth()
    try:
        t0 = time.monotonic()
        with pytest.raises(Busy) as refused:  # nothing listens: refused within the check's deadlines
            await backend.admit()
        assert refused.value.status == 503 and time.monotonic() - t0 < 2 * settings.deadline_s + 1
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await asyncio.gather(*(backend.admit() for _ in range(8)))  # all admitted, none refused
        assert worker.health_calls == 1  # one check, shared by the eight
        with backend.generation(job(tok)) as gen:
            [result] = await gen.collect()
        assert result.token_ids == [5]
    finally:
        await backend.pool.close()
        await server.stop(0)


async def test_a_closed_door_holds_new_requests_and_waits_for_the_running_ones(tok):
    # What a weight update does: the request already running is counted until it ends; one that comes meanwhile
    # waits at the door instead of reaching the workers, and goes on once the door opens.
    ids = tok.encode("one two three four five", add_special_tokens=False)
    server, addr = await serve(ScriptedWorker([[t] for t in ids], delay=0.1))
    backend = await make_backend(tok, [addr])
    door = backend.door

    async def request() -> str:
        await backend.admit()
        with backend.generation(job(tok)) as gen:
            [result] = await gen.collect()
        return result.text

    try:
        running = asyncio.create_task(request())
        for _ in range(500):
            if door.in_flight:
                break
            await asyncio.sleep(0.01)
        assert door.in_flight == 1
        door.close()
        waiting = asyncio.create_task(request())
        assert not await door.drained(0.1)  # the running one is still counted
        assert await door.drained(10) and await running == "one two three four five"
        await asyncio.sleep(0.2)
        assert not waiting.done() and door.in_flight == 0  # held at the door, nothing sent to the worker
        door.open()
        assert await asyncio.wait_for(waiting, 10) == "one two three four five"
    finally:
        await backend.pool.close()
        await server.stop(0)


async def test_dead_worker_before_any_output_is_retried_on_another(tok):
    ids = tok.encode("fine", add_special_tokens=False)
    dead_worker, live_worker = ScriptedWorker([[t] for t in ids]), ScriptedWorker([[t] for t in ids])
    dead_server, dead = await serve(dead_worker)
    live_server, live = await serve(live_worker)
    backend = await make_backend(tok, [dead, live])
    await dead_server.stop(0)  # dies after the pool saw it healthy
    try:
        for _ in range(2):  # round robin would pick the dead one first or second
            with backend.generation(job(tok)) as gen:
                [result] = await gen.collect()
            assert result.text == "fine" and gen.pair.generate.address == live
        assert not backend.pool.workers[dead].healthy
        assert backend.metrics.retries._value.get() >= 1
    finally:
        await backend.pool.close()
        await live_server.stop(0)


async def test_worker_taken_out_fails_its_streams_fast(tok):
    worker = ScriptedWorker([[5]] * 1000, delay=0.05)
    server, addr = await serve(worker)
    backend = await make_backend(tok, [addr])
    try:
        with backend.generation(job(tok)) as gen:
            updates = gen.updates()
            await updates.__anext__()  # output reached the client: no retry possible any more
            asyncio.get_running_loop().call_later(0.1, backend.pool.take_out, backend.pool.workers[addr], "test")
            with pytest.raises(ApiError) as info:
                async for _ in updates:
                    pass
        assert info.value.status == 503 and "down" in info.value.message
        await asyncio.wait_for(worker.ended.wait(), 5)
        assert not worker.completed
    finally:
        await backend.pool.close()
        await server.stop(0)


async def test_consumer_that_stops_reading_cancels_the_worker_call_at_once(tok):
    worker = ScriptedWorker([[5]] * 1000, delay=0.02)
    server, addr = await serve(worker)
    backend = await make_backend(tok, [addr])
    try:
        with backend.generation(job(tok)) as gen:
            updates = gen.updates()
            for _ in range(3):
                await updates.__anext__()
            await updates.aclose()  # what a client disconnect does to the handler's loop
            await asyncio.wait_for(worker.ended.wait(), 1)
        assert not worker.completed and worker.sent < 10
        assert backend.pool.workers[addr].in_flight == 0 and not backend.pool.workers[addr].on_out
    finally:
        await backend.pool.close()
        await server.stop(0)
