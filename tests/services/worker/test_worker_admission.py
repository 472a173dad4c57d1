"""The worker's Generate admission over real gRPC, with a stand-in engine process that holds every request.

A worker holds at most max_running_requests + max_queued sequences (a request counts n): beyond that a
Generate call is refused at once with RESOURCE_EXHAUSTED (the gateway answers 429). Once the worker drains,
new calls are refused with UNAVAILABLE while those in progress go on.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.services.worker.channel.messages import Abort, Call, Generate
from pdserve.services.worker.front.rpc import Calls, WorkerService
from pdserve.shared.compat import Compat
from pdserve.services.worker.front.colocated_wiring import Colocated
from pdserve.shared.sampling_params import SamplingParams

COMPAT = Compat(model="tiny", dtype="float32", page_size=16, num_layers=2, num_kv_heads=2, head_dim=8,
                transfer_backend="none")


class HoldingEngine:
    """The engine process's link (engine_link.EngineLink): takes every request and never produces output, so each
    Generate call stays in progress."""

    alive = True

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    def watch(self, rid: str, sink) -> None:
        pass

    def unwatch(self, rid: str) -> None:
        pass

    async def call(self, call: Call, timeout: float):
        if isinstance(call, Generate):
            self.added.append(call.rid)
        elif isinstance(call, Abort):
            self.aborted.extend(call.rids)
            return call.rids

    def cast(self, call: Call) -> None:
        if isinstance(call, Abort):
            self.aborted.extend(call.rids)


@pytest.fixture
async def worker():
    engine, calls = HoldingEngine(), Calls()
    info = pb.InfoReply(max_running_requests=2)
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(WorkerService(engine, Colocated(), COMPAT, info, calls=calls,
                                                       max_queued=1), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.WorkerStub(channel), engine, calls
    await channel.close()
    await server.stop(0)


def generate(stub, rid: str, n: int = 1):
    return stub.Generate(pb.GenerateRequest(rid=rid, input_ids=[1, 2, 3],
                                            sampling=params_to_proto(SamplingParams(max_new_tokens=8, n=n))))


async def refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call.read(), 5)
    return info.value.code()


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


async def test_generate_beyond_the_bound_is_refused_at_once_counting_n(worker):
    stub, engine, calls = worker
    held = [generate(stub, "a", n=2)]  # 2 of the 3 places (2 running + 1 queued)
    await wait_until(lambda: engine.added == ["a"])
    assert await refused(generate(stub, "b", n=2)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    held.append(generate(stub, "c"))  # the last place
    await wait_until(lambda: engine.added == ["a", "c"])
    code = await refused(generate(stub, "d"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and engine.added == ["a", "c"]  # never queued
    assert calls.count == 3

    held[0].cancel()  # its places come back, and it is aborted on the engine
    await wait_until(lambda: calls.count == 1 and "a" in engine.aborted)
    held.append(generate(stub, "e", n=2))
    await wait_until(lambda: engine.added[-1] == "e")
    for call in held:
        call.cancel()
    await wait_until(lambda: calls.count == 0)


async def test_a_draining_worker_refuses_new_calls_and_keeps_those_in_progress(worker):
    stub, engine, calls = worker
    running = generate(stub, "a")
    await wait_until(lambda: engine.added == ["a"])
    calls.draining = True
    assert await refused(generate(stub, "b")) == grpc.StatusCode.UNAVAILABLE
    assert engine.added == ["a"] and engine.aborted == [] and calls.count == 1  # "a" goes on
    assert not await calls.wait_idle(0.2)
    running.cancel()
    assert await calls.wait_idle(5)
