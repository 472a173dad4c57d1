"""Decode side of a PD request: ask a prefill worker to fill the pages the engine reserved, and settle them.

Lifecycle of one request (event loop): the engine thread reserved the prompt's pages and calls `start` through
`call_soon_threadsafe` -> the transfer window opens on those pages -> a Prefill call to the named prefill
worker -> on its answer the window closes and the engine gets the first tokens (`DecodeRole.kv_ready`) -> when
the call has ended, whatever its outcome, no write can land in the pages any more: `DecodeRole.kv_settled`
frees those of a request aborted meanwhile. `abort` asks the prefill worker to drop a request; the Prefill
call is left to end by itself, since its end is what proves no write is in flight.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import first_token_from_proto
from pdserve.services.worker.peers import CHANNEL_OPTIONS, PrefillPeers
from pdserve.shared.cluster_auth import worker_channel
from pdserve.shared.engine import Engine

log = logging.getLogger(__name__)


class KVPull:
    def __init__(self, engine: Engine, peers: PrefillPeers, call_timeout_s: float, prefill_timeout_s: float) -> None:
        self.engine = engine
        self.peers = peers
        self.call_timeout_s = call_timeout_s  # for one small call (an abort at the prefill worker)
        # Longer than the prefill worker's own limits, so that it is the one that answers.
        self.deadline_s = call_timeout_s + prefill_timeout_s + 10.0
        self.calls: dict[str, asyncio.Task] = {}  # rid -> its Prefill call
        self.addrs: dict[str, str] = {}  # rid -> the prefill worker filling its pages
        # rid -> the reply (its timings) and the call's own: (sent, answered, transfer window closed), monotonic;
        # until its first output
        self.replies: dict[str, tuple[pb.PrefillReply, tuple[float, float, float]]] = {}
        self._abort_stubs: dict[str, pb_grpc.WorkerStub] = {}

    def start(self, rid: str, request: pb.GenerateRequest, pages: list[int], lora_version: str | None) -> None:
        """On the event loop: the engine reserved `pages` for `rid`."""
        self.addrs[rid] = request.prefill_addr
        self.calls[rid] = asyncio.ensure_future(self._pull(rid, request, pages, lora_version or ""))

    def take_reply(self, rid: str) -> tuple[pb.PrefillReply, tuple[float, float, float]] | None:
        return self.replies.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Ask the prefill worker to drop `rid`, if one is filling its pages."""
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
        engine, transfer = self.engine, self.peers.transfer
        transfer.open_window(pages)
        closed = False
        loop = asyncio.get_running_loop()
        try:
            stub, peer_name = await self.peers.get(request.prefill_addr)
            sent = time.monotonic()
            reply = await stub.Prefill(pb.PrefillRequest(rid=rid, input_ids=request.input_ids,
                                                         sampling=request.sampling, peer_name=peer_name,
                                                         dst_pages=pages, lora=request.lora,
                                                         lora_version=lora_version,
                                                         weights_version=engine.weights.version.label,
                                                         traceparent=request.traceparent),
                                       timeout=self.deadline_s)
            # The prefill worker answers after its last write. Close the window before the engine takes the
            # pages: caching them frees those that duplicate an already cached prefix, and the next request
            # reserved may get one at once; closing later would shut that request's window on it.
            answered = time.monotonic()
            await loop.run_in_executor(None, transfer.close_window, pages)
            closed = True
            firsts = [first_token_from_proto(t) for t in reply.first_tokens]
            self.replies[rid] = reply, (sent, answered, time.monotonic())
            engine.call(lambda: engine.role.kv_ready(rid, firsts, reply.cached_tokens))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            detail = (exc.details() or exc.code().name) if isinstance(exc, grpc.aio.AioRpcError) else exc
            error = f"prefill worker {request.prefill_addr} failed: {detail}"
            log.warning("%s (request %s)", error, rid)
            engine.call(lambda: engine.abort(rid, error=error))
        finally:
            self.calls.pop(rid, None)
            self.addrs.pop(rid, None)
            # The call has ended: the prefill worker answers only after its transfer for `rid` is over and the
            # request is gone there (or it died, or the deadline beyond its own limits passed). Once no write can
            # land in the pages any more (closing the window waits out one already under way, on a thread of its
            # own), they may go back to the pool.
            def settle() -> None:
                if not closed:
                    transfer.close_window(pages)
                engine.call(lambda: engine.role.kv_settled(rid))
            loop.run_in_executor(None, settle)
