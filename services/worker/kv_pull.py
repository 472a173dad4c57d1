"""Decode side of a PD request: ask a prefill worker to fill the pages the engine reserved, and settle them.

Lifecycle of one request: the front expects it (`expect`, before the engine has it) -> the engine process
reserved the prompt's pages and opened the transfer window on them (the "reserved" event, `reserved`) -> a
Prefill call to the named prefill worker -> on its answer the engine closes the window and takes the first tokens
(`kv_answered`: `DecodeRole.kv_ready`) -> when the call has ended, whatever its outcome, no write can land in the
pages any more: `kv_settle` frees those of a request aborted meanwhile. `abort` asks the prefill worker to drop a
request; the Prefill call is left to end by itself, since its end is what proves no write is in flight.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.worker.engine_link import EngineLink
from pdserve.services.worker.peers import CHANNEL_OPTIONS, PrefillPeers
from pdserve.shared.cluster_auth import worker_channel

log = logging.getLogger(__name__)


class KVPull:
    def __init__(self, link: EngineLink, peers: PrefillPeers, call_timeout_s: float, prefill_timeout_s: float,
                 weights_label: Callable[[], str]) -> None:
        self.link = link
        self.peers = peers
        self.weights_label = weights_label  # the weights this worker serves, which its prefill worker must too
        self.call_timeout_s = call_timeout_s  # for one small call (an abort at the prefill worker)
        # Longer than the prefill worker's own limits, so that it is the one that answers.
        self.deadline_s = call_timeout_s + prefill_timeout_s + 10.0
        self.requests: dict[str, pb.GenerateRequest] = {}  # rid -> its Generate request, until its pages come
        self.calls: dict[str, asyncio.Task] = {}  # rid -> its Prefill call
        self.addrs: dict[str, str] = {}  # rid -> the prefill worker filling its pages
        # rid -> the reply (its timings) and the call's own: [sent, answered, transfer window closed], monotonic;
        # until its first output
        self.replies: dict[str, tuple[pb.PrefillReply, list[float]]] = {}
        self._abort_stubs: dict[str, pb_grpc.WorkerStub] = {}

    def expect(self, rid: str, request: pb.GenerateRequest) -> None:
        self.requests[rid] = request

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def reserved(self, rid: str, pages: list[int], lora_version: str) -> None:
        """The engine reserved `pages` for `rid` and opened their window."""
        request = self.requests.pop(rid, None)
        if request is None:  # the Generate call is gone already: drop the request, free the pages
            self.link.cast("abort", rids=[rid])
            self.link.cast("kv_settle", rid=rid, pages=pages, closed=False)
            return
        self.addrs[rid] = request.prefill_addr
        self.calls[rid] = asyncio.ensure_future(self._pull(rid, request, pages, lora_version))

    def take_reply(self, rid: str) -> tuple[pb.PrefillReply, list[float]] | None:
        return self.replies.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Ask the prefill worker to drop `rid`, if one is filling its pages."""
        self.requests.pop(rid, None)
        addr = self.addrs.get(rid)
        if addr is not None:
            asyncio.ensure_future(self._abort_at(addr, rid))

    async def _abort_at(self, addr: str, rid: str) -> None:
        stub = self._abort_stubs.get(addr)
        if stub is None:
            # The reconnect backoff of the Prefill channels: an abort reaches a restarted prefill worker in a second.
            stub = self._abort_stubs[addr] = pb_grpc.WorkerStub(worker_channel(addr, options=CHANNEL_OPTIONS))
        try:
            await stub.Abort(pb.AbortRequest(rid=rid), timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as exc:  # the Prefill call still ends, by its own deadline at worst
            log.debug("aborting %s at prefill worker %s: %s", rid, addr, exc.code().name)

    async def _pull(self, rid: str, request: pb.GenerateRequest, pages: list[int], lora_version: str) -> None:
        closed = False
        try:
            stub, peer_name = await self.peers.get(request.prefill_addr)
            sent = time.monotonic()
            reply = await stub.Prefill(pb.PrefillRequest(rid=rid, input_ids=request.input_ids,
                                                         sampling=request.sampling, peer_name=peer_name,
                                                         dst_pages=pages, lora=request.lora,
                                                         lora_version=lora_version,
                                                         weights_version=self.weights_label(),
                                                         traceparent=request.traceparent),
                                       timeout=self.deadline_s)
            # The prefill worker answers after its last write. The engine closes the window before it takes the
            # pages: caching them frees those that duplicate an already cached prefix, and the next request
            # reserved may get one at once; closing later would shut that request's window on it.
            timing = [sent, time.monotonic(), time.monotonic()]
            self.replies[rid] = reply, timing  # before the first tokens can reach the stream
            firsts = [(t.token_id, (t.logprob, list(t.top.token_ids), list(t.top.logprobs)) if t.has_logprob
                       else None) for t in reply.first_tokens]
            timing[2] = await self.link.call("kv_answered", self.deadline_s, rid=rid, pages=pages, firsts=firsts,
                                             cached_tokens=reply.cached_tokens)
            closed = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            detail = (exc.details() or exc.code().name) if isinstance(exc, grpc.aio.AioRpcError) else exc
            error = f"prefill worker {request.prefill_addr} failed: {detail}"
            log.warning("%s (request %s)", error, rid)
            self.replies.pop(rid, None)
            self.link.cast("abort", rids=[rid], error=error)
        finally:
            self.calls.pop(rid, None)
            self.addrs.pop(rid, None)
            # The call has ended: the prefill worker answers only after its transfer for `rid` is over and the
            # request is gone there (or it died, or the deadline beyond its own limits passed). Once no write can
            # land in the pages any more (closing the window waits out one already under way), they may go back
            # to the pool.
            self.link.cast("kv_settle", rid=rid, pages=pages, closed=closed)
