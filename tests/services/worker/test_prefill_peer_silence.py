"""A prefill worker drops the connection of a decode worker that stopped registering (it died or was scaled
away) instead of keeping one per decode worker it ever saw; a decode worker that registers again is kept.

Unit test of PrefillService's bookkeeping: the engine process answers each call at once and its transfer is a set
of names, standing in for the process and the connections below the logic under test."""
from __future__ import annotations

import asyncio

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import compat_to_proto
from pdserve.services.worker.channel.messages import AddPeer, Call, RemovePeer
from pdserve.services.worker.front.prefill_rpc import PrefillService
from pdserve.services.worker.front.rpc import Timeouts
from pdserve.shared.compat import Compat

COMPAT = Compat(model="tiny", dtype="float32", page_size=16, num_layers=2, num_kv_heads=2, head_dim=8,
                transfer_backend="tcp")


class Connections:
    """The engine process's side of registration (prefill_engine.PrefillEngine.add_peer, remove_peer)."""

    def __init__(self) -> None:
        self.peers: set[str] = set()
        self.removals = 0

    async def call(self, call: Call, timeout: float):
        if isinstance(call, AddPeer):
            known = call.name in self.peers
            self.peers.add(call.name)
            return known, b"prefill"
        assert isinstance(call, RemovePeer)
        self.removals += 1
        self.peers.discard(call.name)


async def register(service: PrefillService, name: str) -> pb.RegisterReply:
    request = pb.RegisterRequest(peer_name=name, compat=compat_to_proto(COMPAT), transfer_metadata=b"decode")
    return await service.Register(request, None)


async def test_a_decode_worker_silent_past_the_limit_is_dropped_and_one_that_comes_back_is_not():
    connections = Connections()
    service = PrefillService(connections, COMPAT, Timeouts(peer_silence=0.3))
    for name in ("decode-a", "decode-b"):
        assert (await register(service, name)).ok
    assert connections.peers == {"decode-a", "decode-b"}
    for _ in range(4):  # b keeps registering, as a live decode worker does every second; a has died
        await asyncio.sleep(0.1)
        assert (await register(service, "decode-b")).ok
    assert connections.peers == {"decode-b"} and set(service.registered_at) == {"decode-b"}
    assert connections.removals == 1  # dropped on the engine thread, once
    assert (await register(service, "decode-a")).ok  # a restarted worker of the same name is welcome again
    assert connections.peers == {"decode-a", "decode-b"}


class BusyOnce(Connections):
    """An engine thread that is busy (a long KV write) the first time a peer is to be dropped."""

    async def call(self, call: Call, timeout: float):
        if isinstance(call, RemovePeer) and self.removals == 0:
            self.removals += 1
            raise asyncio.TimeoutError  # the wait for the engine timed out
        return await super().call(call, timeout)


async def test_a_drop_that_the_busy_engine_could_not_run_is_tried_again():
    connections = BusyOnce()
    service = PrefillService(connections, COMPAT, Timeouts(peer_silence=0.3, engine_call=0.05))
    for name in ("decode-a", "decode-b"):
        assert (await register(service, name)).ok
    for _ in range(8):
        await asyncio.sleep(0.1)
        assert (await register(service, "decode-b")).ok
    # The first try timed out (before, the peer was forgotten there and its connection kept for good).
    assert connections.peers == {"decode-b"} and set(service.registered_at) == {"decode-b"} and \
        connections.removals >= 2
