"""A decode worker's registrations with a prefill worker survive the prefill worker's restarts.

The prefill side here is a scripted gRPC servicer on loopback that, like the real one, knows the decode
workers that registered since it started and refuses Prefill from others with FAILED_PRECONDITION.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.worker.front.peers import RECONNECT_WAIT_S, PeerError, PrefillPeers
from pdserve.shared.compat import Compat
from procs import free_port

COMPAT = Compat(model="tiny", dtype="float32", page_size=16, num_layers=2, num_kv_heads=2, head_dim=8,
                transfer_backend="tcp")


class ScriptedPrefill(pb_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.known: set[str] = set()
        self.registrations = 0
        self.prefills = 0

    async def Register(self, request, context):
        self.registrations += 1
        self.known.add(request.peer_name)
        return pb.RegisterReply(ok=True)

    async def Prefill(self, request, context):
        if request.peer_name not in self.known:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"decode worker {request.peer_name} is not "
                                                                     f"registered")
        self.prefills += 1
        return pb.PrefillReply(cached_tokens=7)


async def serve(port: int) -> tuple[grpc.aio.Server, ScriptedPrefill]:
    servicer = ScriptedPrefill()
    server = grpc.aio.server()
    pb_grpc.add_PrefillServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server, servicer


async def wait_until(predicate, timeout: float = 5.0) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < timeout, "not within the time limit"
        await asyncio.sleep(0.05)
    return loop.time() - start


@pytest.fixture
async def prefill():
    port = free_port()
    server, servicer = await serve(port)
    state = {"addr": f"127.0.0.1:{port}", "port": port, "server": server, "servicer": servicer}
    yield state
    await state["server"].stop(0)


async def test_a_prefill_call_refused_as_unregistered_registers_again_and_is_resent(prefill):
    peers = PrefillPeers("decode-a", COMPAT, b"{}", refresh_s=3600)  # no background renewal here
    client, name = await peers.get(prefill["addr"])
    servicer = prefill["servicer"]
    assert (name, servicer.registrations) == ("decode-a", 1)
    servicer.known.clear()  # the prefill worker restarted and forgot us
    reply = await client.Prefill(pb.PrefillRequest(rid="r1", peer_name=name), timeout=5)
    assert reply.cached_tokens == 7
    assert (servicer.registrations, servicer.prefills) == (2, 1)


async def test_a_restarted_prefill_worker_has_us_registered_again_within_seconds(prefill):
    peers = PrefillPeers("decode-b", COMPAT, b"{}", refresh_s=0.2)
    await peers.register_all([prefill["addr"]], deadline_s=5)
    await prefill["server"].stop(0)
    # Down: using it fails within the reconnect wait, no hang (gRPC's error, or ours once the renewal noticed).
    with pytest.raises((PeerError, grpc.aio.AioRpcError), match=prefill["addr"]):
        client, name = await asyncio.wait_for(peers.get(prefill["addr"]), 1 + RECONNECT_WAIT_S)
        await client.Prefill(pb.PrefillRequest(rid="r0", peer_name=name), timeout=1)
    await asyncio.sleep(1.5)  # down for a while: gRPC's reconnect backoff must not keep us away once it is back
    prefill["server"], servicer = await serve(prefill["port"])
    assert await wait_until(lambda: "decode-b" in servicer.known) < 2.5  # no request needed
    client, name = await peers.get(prefill["addr"])
    reply = await client.Prefill(pb.PrefillRequest(rid="r1", peer_name=name), timeout=5)
    assert reply.cached_tokens == 7 and servicer.prefills == 1


async def test_a_request_right_after_a_prefill_worker_came_back_registers_without_waiting_for_a_renewal(prefill):
    # The gateway routes to a restarted prefill worker as soon as it answers its health checks, while our channel
    # to it may still sit in gRPC's reconnect backoff: the request's registration must wait that out, not fail.
    peers = PrefillPeers("decode-c", COMPAT, b"{}", refresh_s=3600)  # no background renewal here
    await peers.get(prefill["addr"])
    await prefill["server"].stop(0)
    with pytest.raises(PeerError, match=prefill["addr"]):
        await peers.register(prefill["addr"], timeout=1)  # noticed while down: the registration is lost
    await asyncio.sleep(0.7)  # the channel's next attempt fails too: it backs off again
    with pytest.raises(PeerError, match=prefill["addr"]):
        await peers.register(prefill["addr"], timeout=1)
    prefill["server"], servicer = await serve(prefill["port"])
    for rid in ("r1", "r2"):
        client, name = await asyncio.wait_for(peers.get(prefill["addr"]), 3)
        reply = await client.Prefill(pb.PrefillRequest(rid=rid, peer_name=name), timeout=5)
        assert reply.cached_tokens == 7
    assert servicer.prefills == 2
