"""Decode side of a PD request: ask a prefill worker to fill the pages the engine reserved, and settle them.

Lifecycle of one request: the front expects it (`expect`, before the engine has it) -> the engine process
reserved the prompt's pages and opened the transfer window on them under a fresh fence (the "reserved" event,
`reserved`) -> a Prefill call to the named prefill worker, carrying the fence and its lease -> on its answer the
engine closes the window and takes the first tokens (`kv_answered`: `DecodeRole.kv_ready`) -> the fence is
settled and `kv_settle` frees the pages of a request aborted meanwhile. Until then they stay quarantined. A
request whose KV is no longer asked for is dropped by the engine before its fence is settled (`abort`), so that
the settle finds its pages in quarantine rather than held by a request still waiting for them.

The fence is settled (shared/transfer/fence.py) by the Prefill call's answer (the prefill worker answers after
its last write), or else by a Fence call the prefill worker answers once no write of it can start or is under
way (tried again every FENCE_RETRY_S), or, where no answer comes, once the lease has surely run out in the
prefill worker's clock. Where every write passes the receiver's check (TCP's socket), closing the window is
enough (`kv_settle` does, waiting out a write already landing). The end of the Prefill call alone proves
nothing: a call that this side cancelled or that hit its deadline ends here while the prefill worker may still
be writing. So `abort` cancels the Prefill call at once, and the pages come back as soon as the fence is settled.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import first_token_from_proto
from pdserve.services.worker.front.engine_link import EngineLink
from pdserve.services.worker.channel.messages import Abort, KVAnswered, KVSettle, PagesReserved
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
        self.requests: dict[str, pb.GenerateRequest] = {}  # rid -> its Generate request, until its pages come
        self.calls: dict[str, asyncio.Task] = {}  # rid -> its Prefill call
        # rid -> the reply (its timings) and the call's own: [sent, answered, transfer window closed], monotonic;
        # until its first output
        self.replies: dict[str, tuple[pb.PrefillReply, list[float]]] = {}
        self.settling: set[asyncio.Task] = set()  # Fence calls whose answers the pages wait for

    def expect(self, rid: str, request: pb.GenerateRequest) -> None:
        self.requests[rid] = request

    def reserved(self, event: PagesReserved) -> None:
        """The engine reserved the pages of `event.rid` and opened their window under its fence."""
        rid, pages = event.rid, event.pages
        request = self.requests.pop(rid, None)
        if request is None:  # the Generate call is gone already: drop the request, free the pages
            self.link.cast(Abort([rid]))
            self.link.cast(KVSettle(rid, pages, closed=False))
            return
        call = self.calls[rid] = asyncio.ensure_future(self._pull(rid, request, pages, event.lora_version,
                                                                  event.fence, event.checked))
        call.add_done_callback(lambda _: self._never_started(rid, call, pages))

    def _never_started(self, rid: str, call: asyncio.Task, pages: list[int]) -> None:
        """A call cancelled before its first step never ran its `finally`: nothing was sent, the pages go back."""
        if self.calls.get(rid) is call:
            del self.calls[rid]
            self.link.cast(KVSettle(rid, pages, closed=False))

    def take_reply(self, rid: str) -> tuple[pb.PrefillReply, list[float]] | None:
        return self.replies.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Stop asking for `rid`'s KV: its Prefill call is cancelled, and the fence settled before the pages go.

        The engine is told to drop the request here, before the settle: the caller's own abort may have reached
        the engine before the request did (an Abort sent beside its Generate finds nothing there), and a request
        left waiting for the KV of a cancelled call would hold its pages for good. Its pages were reserved, so the
        engine has it by now; the drop puts them in quarantine, and the settle that follows frees them."""
        self.requests.pop(rid, None)
        call = self.calls.get(rid)
        if call is not None:
            self.link.cast(Abort([rid]))
            call.cancel()

    async def _pull(self, rid: str, request: pb.GenerateRequest, pages: list[int], lora_version: str,
                    fence: int, checked: bool) -> None:
        closed = answered = False
        lease = Lease(self.deadline_s)
        peer_name = self.peers.name
        try:
            stub, peer_name = await self.peers.get(request.prefill_addr)
            sent = time.monotonic()
            reply = await stub.Prefill(pb.PrefillRequest(rid=rid, input_ids=request.input_ids,
                                                         sampling=request.sampling, peer_name=peer_name,
                                                         dst_pages=pages, lora=request.lora,
                                                         lora_version=lora_version,
                                                         weights_version=self.weights_label(),
                                                         traceparent=request.traceparent, fence=fence),
                                       timeout=self.deadline_s, lease=lease)
            answered = True  # after the prefill worker's last write: the fence is settled
            self.calls.pop(rid, None)  # an abort from now on leaves the engine to drop the request
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
            raise
        except Exception as exc:
            detail = (exc.details() or exc.code().name) if isinstance(exc, grpc.aio.AioRpcError) else exc
            error = f"prefill worker {request.prefill_addr} failed: {detail}"
            log.warning("%s (request %s)", error, rid)
            self.replies.pop(rid, None)
            self.link.cast(Abort([rid], error))
        finally:
            self.calls.pop(rid, None)
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
