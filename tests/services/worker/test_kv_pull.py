"""KVPull's order of what it tells the engine when a Prefill call is cancelled (a unit test of the logic above the
engine link and the prefill peers, both stand-ins here; the processes themselves: tests/integration/test_pd_*)."""
from __future__ import annotations

import asyncio
import time

from pdserve.proto import worker_pb2 as pb
from pdserve.services.worker.channel.messages import Abort, Call, KVSettle, PagesReserved
from pdserve.services.worker.front.kv_pull import KVPull
from pdserve.shared.transfer.fence import PeerClock


class Link:
    def __init__(self) -> None:
        self.casts: list[Call] = []

    def cast(self, call: Call) -> None:
        self.casts.append(call)


class Client:
    """A prefill worker that takes the call and never answers, and revokes a fence when asked."""

    def __init__(self) -> None:
        self.sent = asyncio.Event()

    async def Prefill(self, request, timeout, lease):  # noqa: N802
        now = time.monotonic()
        request.fence_deadline = lease.stamp(PeerClock(now, now, now))
        self.sent.set()
        await asyncio.Event().wait()

    async def Fence(self, request, timeout):  # noqa: N802
        return pb.FenceReply(fenced=True)


class Peers:
    name = "decode-1"

    def __init__(self) -> None:
        self.client = Client()

    async def get(self, addr: str):
        return self.client, self.name


async def test_an_aborted_pull_drops_the_request_at_the_engine_before_its_pages_are_settled():
    """The caller's abort may have reached the engine before the request did: the pull's own drop must come
    before the settle, or the request keeps waiting for KV that never comes and its pages stay held."""
    link, peers = Link(), Peers()
    pull = KVPull(link, peers, call_timeout_s=5.0, prefill_timeout_s=5.0, weights_label=lambda: "w")
    pull.expect("r1", pb.GenerateRequest(rid="r1", input_ids=[1, 2, 3], prefill_addr="prefill:1"))
    pull.reserved(PagesReserved("r1", [4, 5], "", fence=7, checked=False))
    await asyncio.wait_for(peers.client.sent.wait(), 5)
    pull.abort("r1")
    for _ in range(100):
        if not pull.calls and not pull.settling:
            break
        await asyncio.sleep(0.01)
    assert link.casts == [Abort(["r1"]), KVSettle("r1", [4, 5], closed=False, lease_expired=False)]


async def test_a_pull_aborted_before_its_first_step_drops_the_request_then_gives_the_pages_back():
    link, peers = Link(), Peers()
    pull = KVPull(link, peers, call_timeout_s=5.0, prefill_timeout_s=5.0, weights_label=lambda: "w")
    pull.expect("r1", pb.GenerateRequest(rid="r1", input_ids=[1, 2, 3], prefill_addr="prefill:1"))
    pull.reserved(PagesReserved("r1", [4, 5], "", fence=7, checked=False))
    pull.abort("r1")
    await asyncio.sleep(0.05)
    assert [type(c) for c in link.casts] == [Abort, KVSettle]
    assert not pull.calls and not peers.client.sent.is_set()
