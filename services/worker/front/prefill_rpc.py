"""The Prefill service, served by prefill workers: decode workers register, then ask for prompts to be filled.

A Prefill call lives as long as its request in the engine process: admission (after the peer-weights check, on
the engine thread), chunked prefill, the KV write into the caller's pages, then the answer with the first tokens.
The pages are the caller's under a fence (shared/transfer/fence.py) that every write carries. A call that ends
early (cancelled, timed out) revokes the fence, so no write of it starts any more, and aborts the request; the
decode worker asks the same with a Fence call, and gives the pages back once it is answered. What could not be
done (the engine did not drop the request in time) is logged, counted and answered, not swallowed: the writes
stay refused whatever the engine does.

A decode worker serves it too, for its live moves only (`moves_only`): a call naming `source_rid` is answered with
that frozen generation's KV (shared/roles/move_out.py) instead of a prompt computed.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import compat_from_proto, first_token_to_proto, prompt_logprobs_to_proto
from pdserve.services.worker.front import spans
from pdserve.services.worker.channel.wire import EngineGone, RemoteError
from pdserve.services.worker.front.engine_link import EngineLink
from pdserve.services.worker.channel.messages import Abort, AddPeer, Fence, MoveOut, Prefill, RemovePeer
from pdserve.services.worker.front.rpc import CODES, Calls, Timeouts
from pdserve.shared.compat import Compat
from pdserve.shared.outputs import FirstToken, TokenLogprobs
from pdserve.shared.transfer.fence import WRITE_BOUND_S

MAX_LEASE_S = 3600.0  # a fence deadline further ahead than this was computed from another process's clock

log = logging.getLogger(__name__)


class PrefillService(pb_grpc.PrefillServicer):
    def __init__(self, link: EngineLink, compat: Compat, timeouts: Timeouts = Timeouts(),
                 calls: Calls | None = None, page_bytes: int = 0, transfer_name: str = "",
                 moves_only: bool = False) -> None:
        self.link = link
        self.moves_only = moves_only  # a decode worker: no prompt is filled here, only its frozen generations go
        self.compat = compat
        self.timeouts = timeouts
        self.calls = calls or Calls()  # a draining worker still fills prompts decode workers already took
        self.page_bytes, self.transfer_name = page_bytes, transfer_name  # what a prefill's span reports
        self.registered_at: dict[str, float] = {}  # decode worker -> when it last registered (loop time)

    async def Register(self, request: pb.RegisterRequest, context):
        theirs = compat_from_proto(request.compat)
        problems = self.compat.mismatches(theirs, me="prefill", peer="decode")
        if problems:
            msg = f"decode worker {request.peer_name} is incompatible: " + "; ".join(problems)
            log.error(msg)
            return pb.RegisterReply(ok=False, error=msg)
        try:  # idempotent: the same name and metadata again leave the connection as it is
            known, metadata = await self.link.call(AddPeer(request.peer_name, request.transfer_metadata),
                                                   self.timeouts.engine_call)
        except (RemoteError, EngineGone, asyncio.TimeoutError) as exc:
            return pb.RegisterReply(ok=False, error=f"cannot reach decode worker {request.peer_name}: {exc}")
        if not known:  # decode workers register again every second; only a new one is news
            log.info("registered decode worker %s", request.peer_name)
        now = asyncio.get_running_loop().time()
        self.registered_at[request.peer_name] = now
        await self._forget_silent_peers(now)
        return pb.RegisterReply(ok=True, transfer_metadata=metadata, clock=time.monotonic())

    async def _forget_silent_peers(self, now: float) -> None:
        for peer, seen in [(p, seen) for p, seen in self.registered_at.items()
                           if now - seen > self.timeouts.peer_silence]:
            del self.registered_at[peer]
            # On the engine thread, where KV transfers run: none to this peer is under way while it goes.
            try:
                await self.link.call(RemovePeer(peer), self.timeouts.engine_call)
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

    async def Fence(self, request: pb.FenceRequest, context):
        result = await self._revoke(request.rid, request.peer_name, request.fence)
        return pb.FenceReply(fenced=result["fenced"], error=result["error"])

    async def _revoke(self, rid: str, peer_name: str, fence: int) -> dict:
        """No write of `fence` starts from now on and none is under way; then the request is dropped."""
        try:
            if not fence:  # an unfenced caller: the engine's abort is all there is
                await self.link.call(Abort([rid]), self.timeouts.engine_call)
                return {"fenced": True, "error": ""}
            return await self.link.call(Fence(rid, peer_name, fence), self.timeouts.engine_call + WRITE_BOUND_S)
        except (RemoteError, EngineGone, asyncio.TimeoutError) as exc:
            error = f"could not revoke the KV reservation of {rid} at {peer_name}: {type(exc).__name__}: {exc}"
            log.error(error)
            return {"fenced": False, "error": error}

    async def _prefill(self, request: pb.PrefillRequest, context):
        arrived = time.monotonic()
        deadline = request.fence_deadline if request.fence else float("inf")
        if request.fence and deadline - arrived > MAX_LEASE_S:  # the decode worker registers again and resends
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the pages' fence deadline is not in this "
                                "worker's clock (it restarted since the decode worker registered)")
        if deadline <= arrived:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the pages' reservation ran out of time before "
                                "the prefill call arrived")
        span = spans.start("prefill", request.traceparent, {"pdserve.rid": request.rid,
                                                             "pdserve.decode_worker": request.peer_name})
        done, result = False, None
        try:
            # FAILED_PRECONDITION (the peer is not registered: we restarted since) makes the decode side register
            # again and resend (peers.PrefillClient).
            limit = self.timeouts.engine_call + self.timeouts.prefill
            if request.source_rid:
                call = MoveOut(request.source_rid, list(request.input_ids), request.peer_name,
                               list(request.dst_pages), request.fence, deadline)
            elif self.moves_only:
                raise RemoteError("precondition", "this is a decode worker: it fills no prompts (it only hands over "
                                  "its own generations' KV)")
            else:
                call = Prefill(request.rid, list(request.input_ids), request.sampling.SerializeToString(), arrived,
                               request.peer_name, list(request.dst_pages), request.lora, request.lora_version,
                               request.weights_version, span is not None, request.fence, deadline)
            result = await asyncio.wait_for(self.link.call(call, limit), limit)
            done = True
        except RemoteError as exc:
            done = True
            await context.abort(CODES.get(exc.kind, grpc.StatusCode.INTERNAL), str(exc))
        except EngineGone as exc:
            done = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        finally:
            if not done:  # cancelled by the decode side (or it died) or timed out: no write of this request
                # may land any more, and its request goes (the decode side's Fence call asks the same and waits
                # for the answer before it reuses the pages)
                await self._revoke(request.source_rid or request.rid, request.peer_name, request.fence)
            if span is not None and result is None:
                spans.end_failed(span, "the prefill did not complete (refused, cancelled or timed out)")
        if span is not None and result["trace"]:
            spans.end_prefill(span, spans.ReqTrace(**result["trace"]), result, self.page_bytes, self.transfer_name)
        return pb.PrefillReply(first_tokens=[first_token(t, lp) for t, lp in result["first_tokens"]],
                               cached_tokens=result["cached_tokens"], queue_s=result["queue_s"],
                               compute_s=result["compute_s"], transfer_s=result["transfer_s"],
                               host_cached_tokens=result["tier_tokens"].get("host", 0),
                               storage_cached_tokens=result["tier_tokens"].get("storage", 0),
                               kv_bytes=result.get("bytes", 0),
                               input_logprobs=prompt_logprobs_to_proto(
                                   [TokenLogprobs.from_wire(lp) for lp in result["input_logprobs"]]),
                               total_s=time.monotonic() - arrived)


def first_token(token_id: int, lp) -> pb.FirstToken:
    return first_token_to_proto(FirstToken(token_id, None if lp is None else TokenLogprobs.from_wire(lp)))


class PrefillGate(pb_grpc.PrefillServicer):
    """The Prefill service of a worker that may switch roles (front/role_switch.py): served while it is a prefill
    worker (`current()` is its PrefillService), refused otherwise, so a decode worker that still has this address
    learns at once that it is no prefill worker now."""

    def __init__(self, current) -> None:
        self.current = current

    async def Register(self, request: pb.RegisterRequest, context):
        service = self.current()
        if service is None:
            return pb.RegisterReply(ok=False, error="this worker is no prefill worker now (its role was switched)")
        return await service.Register(request, context)

    async def Prefill(self, request: pb.PrefillRequest, context):
        return await (await self._serving(context)).Prefill(request, context)

    async def Fence(self, request: pb.FenceRequest, context):
        return await (await self._serving(context)).Fence(request, context)

    async def _serving(self, context) -> PrefillService:
        service = self.current()
        if service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is no prefill worker now (its role was "
                                                             "switched)")
        return service
