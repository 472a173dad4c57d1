"""KVPull's order of what it tells the engine when a Prefill call is cancelled (a unit test of the logic above the
engine link and the prefill peers, both stand-ins here; the processes themselves: tests/integration/test_pd_*)."""
from __future__ import annotations

import asyncio
import time

from pdserve.proto import worker_pb2 as pb
from pdserve.services.worker.channel.messages import Abort, Call, KVAnswered, KVSettle, PagesReserved
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
        if len(link.casts) == 2 and not pull.settling:  # dropped at the engine, then settled
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
    assert not pull.pulls and not peers.client.sent.is_set()


class Answering(Client):
    """A prefill worker that fills the pages and answers with the first token."""

    async def Prefill(self, request, timeout, lease):  # noqa: N802
        self.sent.set()
        return pb.PrefillReply(first_tokens=[pb.FirstToken(token_id=42)], cached_tokens=3)


class AnsweringLink(Link):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    async def call(self, call: Call, timeout: float):
        self.calls.append(call)
        return 123.0  # when the engine closed the window


async def test_a_pull_runs_from_its_reservation_to_the_first_tokens_and_settles_the_pages():
    link, peers = AnsweringLink(), Peers()
    peers.client = Answering()
    pull = KVPull(link, peers, call_timeout_s=5.0, prefill_timeout_s=5.0, weights_label=lambda: "w")
    pull.expect("r1", pb.GenerateRequest(rid="r1", input_ids=[1, 2, 3], prefill_addr="prefill:1"))
    pull.reserved(PagesReserved("r1", [4, 5], "", fence=7, checked=False))
    for _ in range(100):
        if link.casts:
            break
        await asyncio.sleep(0.01)
    assert link.calls == [KVAnswered("r1", [4, 5], [(42, None)], 3)]
    assert link.casts == [KVSettle("r1", [4, 5], closed=True)]  # answered: nothing can land any more
    reply, timing = pull.take_reply("r1")
    assert reply.cached_tokens == 3 and timing[2] == 123.0
    assert not pull.pulls and not pull.reservations


async def test_a_prompt_computed_here_ends_its_pull_and_a_reservation_nobody_waits_for_is_given_back():
    link, peers = Link(), Peers()
    pull = KVPull(link, peers, call_timeout_s=5.0, prefill_timeout_s=5.0, weights_label=lambda: "w")
    pull.expect("local", pb.GenerateRequest(rid="local", input_ids=[1, 2, 3], prefill_addr="prefill:1"))
    await asyncio.sleep(0.01)  # waiting for pages that a prompt computed from this worker's cache never gets
    assert pull.take_reply("local") is None  # its first output came: the pull ends
    await asyncio.sleep(0.01)
    assert not pull.pulls and not pull.reservations and link.casts == [] and not peers.client.sent.is_set()
    pull.reserved(PagesReserved("gone", [9], "", fence=3, checked=False))  # its Generate call ended first
    assert link.casts == [Abort(["gone"]), KVSettle("gone", [9], closed=False)]
