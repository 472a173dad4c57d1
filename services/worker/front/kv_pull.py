"""The decode side of a PD request, from its reservation to its first token: one coroutine per request (`_pull`)
holds every step, wait, timeout and abort of it.

    expect (the Generate call; the engine has the request from now on)
      -> wait for the engine's reservation (`PagesReserved`: pages and a fresh fence, their window open) -- no
         limit of its own: a request that never needs one (its prompt computed here from the cache) or whose
         Generate call ends is cancelled by `abort`
      -> Prefill call to the named prefill worker, carrying the pages, the fence and its lease (`deadline_s`)
      -> KVAnswered: the engine closes the window, then takes the first tokens (its first output follows)
      -> settle: KVSettle gives the pages of a request aborted meanwhile back to the pool; until then they stay
         quarantined.

`abort(rid)` cancels the coroutine wherever it is. Reserved but not answered, it first tells the engine to drop
the request (the caller's own abort may have reached the engine before the request did, and a request left
waiting for KV that never comes would hold its pages for good); the drop puts the pages in quarantine, and the
settle that follows frees them. A reservation whose request is no longer expected (its Generate call ended
first) is dropped and settled at once.

The fence is settled (shared/transfer/fence.py) by the Prefill call's answer (the prefill worker answers after
its last write), or else by a Fence call the prefill worker answers once no write of it can start or is under
way (tried again every FENCE_RETRY_S), or, where no answer comes, once the lease has surely run out in the
prefill worker's clock. Where every write passes the receiver's check (TCP's socket), closing the window is
enough (KVSettle does, waiting out a write already landing). The end of the Prefill call alone proves nothing:
a call that this side cancelled or that hit its deadline ends here while the prefill worker may still be writing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import first_token_from_proto
from pdserve.services.worker.channel.messages import Abort, KVAnswered, KVSettle, PagesReserved
from pdserve.services.worker.front.engine_link import EngineLink
from pdserve.services.worker.front.peers import PrefillPeers
from pdserve.shared.transfer.fence import WRITE_BOUND_S, Lease

log = logging.getLogger(__name__)
FENCE_RETRY_S = 1.0  # between two Fence calls that got no answer


class KVPull:
    def __init__(self, link: EngineLink, peers: PrefillPeers, call_timeout_s: float, prefill_timeout_s: float,
                 weights_label: Callable[[], str]) -> None:
        self.link = link
        self.peers = peers
        self.weights_label = weights_label  # the weights this worker serves, which its prefill worker must too
        self.call_timeout_s = call_timeout_s  # for one small call (a Fence call, beyond the write it waits out)
        # Longer than the prefill worker's own limits, so that it is the one that answers.
        self.deadline_s = call_timeout_s + prefill_timeout_s + 10.0
        self.pulls: dict[str, asyncio.Task] = {}  # rid -> its pull, from `expect` until its pages are taken
        self.reservations: dict[str, asyncio.Future] = {}  # rid -> its reservation, while the pull waits for it
        # rid -> the reply (its timings) and the call's own: [sent, answered, transfer window closed], monotonic;
        # until its first output
        self.replies: dict[str, tuple[pb.PrefillReply, list[float]]] = {}
        self.settling: set[asyncio.Task] = set()  # Fence calls whose answers the pages wait for

    # ------------------------------------------------------------ what the front and the engine tell it
    def expect(self, rid: str, request: pb.GenerateRequest) -> None:
        """A Generate call hands `rid` to the engine: its pull waits for the pages."""
        self.reservations[rid] = asyncio.get_running_loop().create_future()
        pull = self.pulls[rid] = asyncio.ensure_future(self._pull(rid, request))
        pull.add_done_callback(lambda _: self._drop_unasked(rid))

    def reserved(self, event: PagesReserved) -> None:
        """The engine reserved the pages of `event.rid` and opened their window under its fence."""
        waiter = self.reservations.get(event.rid)
        if waiter is None or waiter.done():  # its Generate call is gone already: drop the request, free the pages
            self.link.cast(Abort([event.rid]))
            self.link.cast(KVSettle(event.rid, event.pages, closed=False))
            return
        waiter.set_result(event)

    def abort(self, rid: str) -> None:
        """Stop asking for `rid`'s KV, wherever its pull is."""
        pull = self.pulls.pop(rid, None)
        if pull is not None:
            pull.cancel()

    def take_reply(self, rid: str) -> tuple[pb.PrefillReply, list[float]] | None:
        """The request's first output came (or its call ended): the prefill worker's reply with its timings, if
        its prompt came from one. A pull still waiting then is for a prompt computed here (from the cache): it
        ends, as no reservation will come."""
        pull = self.pulls.get(rid)
        if pull is not None and rid in self.reservations:
            self.abort(rid)
        return self.replies.pop(rid, None)

    # ------------------------------------------------------------ one request
    async def _pull(self, rid: str, request: pb.GenerateRequest) -> None:
        event = await self.reservations[rid]
        del self.reservations[rid]  # from here on this coroutine settles the pages, whatever ends it
        pages, fence, checked = event.pages, event.fence, event.checked
        closed = answered = False
        lease = Lease(self.deadline_s)
        peer_name = self.peers.name
        try:
            stub, peer_name = await self.peers.get(request.prefill_addr)
            sent = time.monotonic()
            # A live move names the decode worker the generation froze on, which checks the tokens it continues.
            ids = [*request.input_ids, *(t for c in request.resume for t in c.output_ids)] \
                if request.kv_source_rid else request.input_ids
            reply = await stub.Prefill(pb.PrefillRequest(rid=rid, input_ids=ids, source_rid=request.kv_source_rid,
                                                         sampling=request.sampling, peer_name=peer_name,
                                                         dst_pages=pages, lora=request.lora,
                                                         lora_version=event.lora_version,
                                                         weights_version=self.weights_label(),
                                                         traceparent=request.traceparent, fence=fence),
                                       timeout=self.deadline_s, lease=lease)
            answered = True  # after the prefill worker's last write: the fence is settled
            self.pulls.pop(rid, None)  # an abort from now on leaves the engine to drop the request
            # The engine closes the window before it takes the pages: caching them frees those that duplicate an
            # already cached prefix, and the next request reserved may get one at once; closing later would shut
            # that request's window on it.
            timing = [sent, time.monotonic(), time.monotonic()]
            self.replies[rid] = reply, timing  # before the first tokens can reach the stream
            firsts = [(first.token_id, first.logprob and first.logprob.to_wire())
                      for first in map(first_token_from_proto, reply.first_tokens)]
            timing[2] = await self.link.call(KVAnswered(rid, pages, firsts, reply.cached_tokens), self.deadline_s)
            closed = True
        except asyncio.CancelledError:
            if not answered:  # the engine drops it before the settle below frees its pages
                self.link.cast(Abort([rid]))
            raise
        except Exception as exc:
            detail = (exc.details() or exc.code().name) if isinstance(exc, grpc.aio.AioRpcError) else exc
            error = f"prefill worker {request.prefill_addr} failed: {detail}"
            log.warning("%s (request %s)", error, rid)
            self.replies.pop(rid, None)
            self.link.cast(Abort([rid], error))
        finally:
            self.pulls.pop(rid, None)
            if answered or not lease.settled_by or checked:  # answered, never sent, or refused at landing
                self.link.cast(KVSettle(rid, pages, closed))
            else:
                task = asyncio.ensure_future(self._settle(rid, request.prefill_addr, peer_name, fence, lease, pages))
                self.settling.add(task)
                task.add_done_callback(self.settling.discard)

    async def _settle(self, rid: str, addr: str, peer_name: str, fence: int, lease: Lease, pages: list[int]) -> None:
        """Give the pages back once the prefill worker revoked the fence, or the lease surely ran out."""
        expired = False
        while True:
            try:
                client, _ = await self.peers.get(addr)
                reply = await client.Fence(pb.FenceRequest(rid=rid, peer_name=peer_name, fence=fence),
                                           timeout=self.call_timeout_s + WRITE_BOUND_S)
                if reply.error:
                    log.warning("prefill worker %s, revoking the KV reservation of %s: %s", addr, rid, reply.error)
                if reply.fenced:
                    break
            except Exception as exc:  # unreachable, or refused: the lease bounds the wait
                detail = (exc.details() or exc.code().name) if isinstance(exc, grpc.aio.AioRpcError) else exc
                log.warning("prefill worker %s did not revoke the KV reservation of %s (%s): its pages stay held",
                            addr, rid, detail)
            left = lease.settled_by - time.monotonic()
            if left <= 0:
                expired = True
                log.warning("the KV reservation of %s at prefill worker %s ran out of its lease unacknowledged: its "
                            "pages go back to the pool (no write of it can land any more)", rid, addr)
                break
            await asyncio.sleep(min(FENCE_RETRY_S, left))
        self.link.cast(KVSettle(rid, pages, closed=False, lease_expired=expired))

    def _drop_unasked(self, rid: str) -> None:
        """A pull ended before it took its reservation (cancelled while it waited, or before its first step):
        pages reserved meanwhile are dropped and settled here; none reserved, nothing is left to do."""
        waiter = self.reservations.pop(rid, None)
        if waiter is not None and waiter.done() and not waiter.cancelled():
            event = waiter.result()
            self.link.cast(Abort([rid]))
            self.link.cast(KVSettle(rid, event.pages, closed=False))
