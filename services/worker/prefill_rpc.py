"""The Prefill service, served by prefill workers: decode workers register, then ask for prompts to be filled.

A Prefill call lives as long as its request here: admission (after the peer-weights check, on the engine
thread), chunked prefill, the KV write into the caller's pages, then the answer with the first tokens. A call
that ends early (cancelled, timed out) aborts the request and answers only once no write can be in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Future

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import compat_from_proto, first_token_to_proto, params_from_proto, prompt_logprobs_to_proto
from pdserve.services.worker import spans
from pdserve.services.worker.rpc import Calls, Timeouts, grammar_of
from pdserve.shared.compat import Compat
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req, TransferTarget
from pdserve.shared.sampling_params import InvalidParam

log = logging.getLogger(__name__)


class PrefillService(pb_grpc.PrefillServicer):
    def __init__(self, engine: Engine, compat: Compat, transfer, timeouts: Timeouts = Timeouts(),
                 calls: Calls | None = None) -> None:
        self.engine = engine
        self.compat = compat
        self.transfer = transfer
        self.timeouts = timeouts
        self.calls = calls or Calls()  # a draining worker still fills prompts decode workers already took
        self.registered_at: dict[str, float] = {}  # decode worker -> when it last registered (loop time)

    async def Register(self, request: pb.RegisterRequest, context):
        theirs = compat_from_proto(request.compat)
        problems = self.compat.mismatches(theirs, me="prefill", peer="decode")
        if problems:
            msg = f"decode worker {request.peer_name} is incompatible: " + "; ".join(problems)
            log.error(msg)
            return pb.RegisterReply(ok=False, error=msg)
        known = self.transfer.has_peer(request.peer_name)
        try:  # idempotent: the same name and metadata again leave the connection as it is
            await asyncio.to_thread(self.transfer.add_peer, request.peer_name, request.transfer_metadata)
        except Exception as exc:
            return pb.RegisterReply(ok=False, error=f"cannot reach decode worker {request.peer_name}: {exc}")
        if not known:  # decode workers register again every second; only a new one is news
            log.info("registered decode worker %s", request.peer_name)
        now = asyncio.get_running_loop().time()
        self.registered_at[request.peer_name] = now
        await self._forget_silent_peers(now)
        return pb.RegisterReply(ok=True, transfer_metadata=self.transfer.metadata())

    async def _forget_silent_peers(self, now: float) -> None:
        for peer, seen in [(p, seen) for p, seen in self.registered_at.items()
                           if now - seen > self.timeouts.peer_silence]:
            del self.registered_at[peer]
            # On the engine thread, where KV transfers run: none to this peer is under way while it goes.
            forget = self.engine.call(lambda peer=peer: self.transfer.remove_peer(peer))
            try:
                await asyncio.wait_for(asyncio.wrap_future(forget), self.timeouts.engine_call)
            except Exception as exc:  # the engine is busy (maybe writing to that very peer) or stopping
                log.warning("could not drop decode worker %s yet (%r): trying again at the next registration",
                            peer, exc)
                self.registered_at.setdefault(peer, seen)
                continue
            log.info("decode worker %s has not registered for %g s: its connection is dropped", peer,
                     self.timeouts.peer_silence)

    async def Prefill(self, request: pb.PrefillRequest, context):
        with self.calls.hold(1):
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context):
        arrived = time.monotonic()
        if not self.transfer.has_peer(request.peer_name):  # we restarted since it registered
            # FAILED_PRECONDITION makes the decode side register again and resend (peers.PrefillClient).
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"decode worker {request.peer_name} is not registered")
        try:
            params = params_from_proto(request.sampling)
        except (InvalidParam, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        req = Req(rid=request.rid, input_ids=list(request.input_ids), params=params, arrival=arrived,
                  transfer=TransferTarget(request.peer_name, list(request.dst_pages)))
        span = spans.start("prefill", request.traceparent, {"pdserve.rid": request.rid,
                                                             "pdserve.decode_worker": request.peer_name})
        req.grammar = await grammar_of(self.engine, params, context, self.timeouts.engine_call)
        done, result = False, None
        try:
            add = lambda: self._admit(req, request)  # noqa: E731
            fut = await asyncio.wait_for(asyncio.wrap_future(self.engine.call(add)),
                                         self.timeouts.engine_call)
            result = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeouts.prefill)
            done = True
        except (InvalidParam, ValueError) as exc:
            done = True
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        except RuntimeError as exc:
            done = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            if not done:  # cancelled by the decode side (or it died) or timed out: free everything
                # and answer only once the engine thread ran the abort: a transfer of this request runs on
                # that thread, so none is in flight any more and the decode side may reuse the pages.
                aborted = asyncio.wrap_future(self.engine.call(lambda: self.engine.abort(request.rid)))
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(aborted, self.timeouts.engine_call)
            if span is not None and result is None:
                spans.end_failed(span, "the prefill did not complete (refused, cancelled or timed out)")
        if span is not None:
            spans.end_prefill(span, req, result, self.transfer.page_bytes, self.transfer.name)
        return pb.PrefillReply(first_tokens=[first_token_to_proto(t) for t in result.first_tokens],
                               cached_tokens=result.cached_tokens, queue_s=result.queue_s,
                               compute_s=result.compute_s, transfer_s=result.transfer_s,
                               input_logprobs=prompt_logprobs_to_proto(result.input_logprobs),
                               total_s=time.monotonic() - arrived)

    def _admit(self, req: Req, request: pb.PrefillRequest) -> Future:
        """Engine thread: refuse a decode worker that serves other weights (WeightsError, a ValueError), then queue
        the prefill. On this thread no weight swap can come between the check and the request's admission."""
        self.engine.weights.check_peer(request.weights_version)
        return self.engine.role.add(req, request.lora or None, request.lora_version or None)
