"""The Worker gRPC service over one engine process (all roles); prefill workers also serve
`prefill_rpc.PrefillService`.

Thin by design: parse the message, make the engine call (`engine_link.EngineLink`), map results and errors back
to gRPC. A request's outputs come from the link a step at a time, into an asyncio.Queue (Generate) or a StepSink
(GenerateMany). Here: generations (Generate, GenerateMany, Abort) and Health; the operator RPCs are in
admin_rpc.py, the live weight update in weights_rpc.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import output_to_proto, prompt_logprobs_to_proto, resume_from_proto
from pdserve.services import tracing
from pdserve.services.worker.front import spans
from pdserve.services.worker.front.admin_rpc import AdminRpcs
from pdserve.services.worker.channel.wire import EngineGone, RemoteError
from pdserve.services.worker.front.engine_link import EngineLink
from pdserve.services.worker.channel.messages import Abort, Call, Generate, Trace
from pdserve.services.worker.front.kv_events_rpc import KVEventsRpc
from pdserve.services.worker.front.move_rpc import LiveMoves
from pdserve.services.worker.front.generate_many import StepSink, serve_many
from pdserve.services.worker.front.weights_rpc import WeightUpdates
from pdserve.shared.compat import Compat
from pdserve.shared.outputs import ReqOutput, coalesce, is_moved

if TYPE_CHECKING:
    from pdserve.services.worker.front.wiring import Wiring

log = logging.getLogger(__name__)

MAX_QUEUED_SEQUENCES = 1024  # Generate sequences a worker holds beyond its --max-running-requests
# How the front answers an engine call that failed, by the failure's kind (wire.error_kind).
CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
         "precondition": grpc.StatusCode.FAILED_PRECONDITION, "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
         "unavailable": grpc.StatusCode.UNAVAILABLE, "not_found": grpc.StatusCode.NOT_FOUND,
         "weights": grpc.StatusCode.INVALID_ARGUMENT, "internal": grpc.StatusCode.INTERNAL}


def choices_of(request: pb.GenerateRequest) -> int:
    """How many choices the worker runs for `request` (a resumed generation: those still running)."""
    return len(request.resume) or max(1, request.sampling.n)


@dataclass(frozen=True)
class Timeouts:
    """Every wait of a request has a limit (seconds)."""

    engine_call: float = 30.0  # for the engine thread to take a command
    stall: float = 120.0  # between two outputs of a running request
    prefill: float = 120.0  # decode waiting for prefill to fill its pages (incl. queueing)
    # A decode worker registers again every second (peers.PrefillPeers); one silent this long is gone (it died,
    # or was scaled away), and a prefill worker drops its connection. Were it only slow, its next Prefill call
    # is refused as unregistered, and it registers again and resends.
    peer_silence: float = 60.0


class Calls:
    """What a worker has in progress (sequences of Generate calls, Prefill calls) and whether it takes new
    Generate calls: once `draining`, they are refused (UNAVAILABLE) while those in progress go on."""

    def __init__(self) -> None:
        self.count = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def hold(self, count: int):
        self.count += count
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= count
            if self.count == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


async def next_outputs(outputs: asyncio.Queue[ReqOutput], limit_s: float, min_tokens: int) -> list[ReqOutput]:
    """What the engine sent since the last message: at least one output and everything already queued behind it (a
    stream whose event loop fell behind the engine catches up in one message), gathering until `min_tokens`
    tokens (--stream-interval) unless one finishes. TimeoutError past `limit_s` without any output."""
    ready: list[ReqOutput] = []
    while True:
        async with asyncio.timeout(limit_s):  # no task per token, unlike wait_for
            ready.append(await outputs.get())
        while not outputs.empty():
            ready.append(outputs.get_nowait())
        if any(o.finish_reason is not None or o.error for o in ready) or \
                sum(len(o.token_ids) for o in ready) >= min_tokens:
            return ready


class WorkerService(WeightUpdates, AdminRpcs, KVEventsRpc, LiveMoves, pb_grpc.WorkerServicer):
    def __init__(self, link: EngineLink, wiring: Wiring, compat: Compat, info: pb.InfoReply,
                 timeouts: Timeouts = Timeouts(), is_ready: Callable[[], bool] | None = None,
                 on_weights: Callable[[Compat], None] | None = None, calls: Calls | None = None,
                 max_queued: int = MAX_QUEUED_SEQUENCES, stream_interval: int = 1, generates: bool = True) -> None:
        """`wiring`: what this worker's role does (wiring.py); `on_weights`: told this worker's new compatibility
        info after its weights changed. `calls`: what is in progress, shared with the Prefill service; at most
        max_running_requests + `max_queued` sequences."""
        self.link = link
        self.wiring = wiring
        self.calls = calls or Calls()
        self.max_sequences = info.max_running_requests + max_queued
        self.stream_interval = stream_interval  # tokens per message while a stream keeps up (SGLang's)
        self.is_ready = is_ready or (lambda: link.alive)
        self.generates = generates
        self.compat = compat
        self.info = info
        self.timeouts = timeouts
        self.public_ids: dict[str, str] = {}  # rid -> the client's id, of the generations in progress
        self.traced: dict[str, spans.Traced] = {}  # rid -> its span, while a traced generation runs
        self.moving: set[str] = set()  # rids whose stream ended for a live move, until the stream's end
        self.on_weights = on_weights
        self._weights_lock = asyncio.Lock()  # one weight update step at a time

    @property
    def prompt_kv(self):  # where each generation's prompt KV comes from (wiring.ComputedHere, or decode's KVPull)
        return self.wiring.prompt_kv

    async def _engine(self, call: Call, timeout: float | None = None):
        return await self.link.call(call, timeout or self.timeouts.engine_call)

    async def _call_or_abort(self, context, call: Call):
        """An engine call whose failure ends the gRPC call with the matching status and the engine's message."""
        try:
            return await self.link.call(call, self.timeouts.engine_call)
        except RemoteError as exc:
            await context.abort(CODES.get(exc.kind, grpc.StatusCode.INTERNAL), str(exc))
        except EngineGone as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    # ------------------------------------------------------------ Generate
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """One generation per stream, a message per step's outputs (or more, --stream-interval); a reader that
        falls behind gets what queued meanwhile in one message."""
        with self.calls.hold(await self._admit(request, context)):
            outputs: asyncio.Queue[ReqOutput] = asyncio.Queue()

            def deliver(outs: list[ReqOutput]) -> None:
                for out in outs:
                    outputs.put_nowait(out)
            n = await self._start(request, context, deliver)
            finished: set[int] = set()
            first = True
            try:
                while len(finished) < n:
                    ready = await next_outputs(outputs, self._wait_limit(first),
                                               1 if first else self.stream_interval)
                    error = next((o.error for o in ready if o.error), None)
                    moved = [o for o in ready if o.token_ids] if is_moved(error) else []
                    if moved:  # a live move: what it produced here reaches the caller before the stream ends
                        yield self._message(request, moved, first)[0]
                    if error:
                        await self._fail(context, error, request.rid)
                    msg, ended = self._message(request, ready, first)
                    finished |= ended
                    yield msg
                    first = False
            except asyncio.TimeoutError:
                await self._stalled(request, context)
            finally:
                self._end(request, n, finished)

    async def GenerateMany(self, calls, context: grpc.aio.ServicerContext):
        """Generate for each call on one stream, every call's messages of one engine step in one message
        (pdserve.services.worker.front.generate_many): what the gateway uses."""
        async with contextlib.aclosing(serve_many(self._generate_posting, calls, context)) as events:
            async for message in events:
                yield message

    async def _generate_posting(self, request: pb.GenerateRequest, context, post) -> None:
        """A GenerateMany call: as Generate, but each step's outputs become a message there and then (`StepSink`),
        without waking a coroutine per generation per step."""
        with self.calls.hold(await self._admit(request, context)):
            sink = StepSink(choices_of(request), self.stream_interval,
                            lambda ready, first: self._message(request, ready, first), post)

            def deliver(outs: list[ReqOutput]) -> None:
                for out in outs:
                    sink.put_nowait(out)
                sink.flush()
            n = await self._start(request, context, deliver)
            try:
                error = await sink.wait(self._wait_limit)
                if error:
                    await self._fail(context, error, request.rid)
            except asyncio.TimeoutError:
                await self._stalled(request, context)
            finally:
                sink.close()
                self._end(request, n, sink.finished)

    async def _admit(self, request: pb.GenerateRequest, context) -> int:
        """The sequences a generation holds: a bounded number in progress (RESOURCE_EXHAUSTED beyond it), and
        none new while the worker drains (UNAVAILABLE)."""
        n = choices_of(request)
        if self.calls.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down: send the request to "
                                                             "another")
        if self.calls.count + n > self.max_sequences:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this worker holds {self.calls.count} sequences, {n} more would pass its limit of "
                                f"{self.max_sequences}: retry later")
        return n

    async def _start(self, request: pb.GenerateRequest, context, deliver) -> int:
        """Checks the request and hands it to the engine (which reads its sampling parameters: INVALID_ARGUMENT
        for one out of range); each step's outputs of it go to `deliver`. Its number of choices."""
        arrived = time.monotonic()
        refusal = self.wiring.refuses_generate(request)
        if refusal is not None:
            await context.abort(*refusal)
        if not self.generates:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker serves a pooling model (embeddings or scores): it does not generate")
        role = self.wiring.role.value
        span = spans.start(f"{role} generate", request.traceparent, {"pdserve.rid": request.rid, "pdserve.role": role})
        if span is not None:
            self.traced[request.rid] = spans.Traced(span)
            request.traceparent = tracing.traceparent_of(span)  # the Prefill call (kv_pull) goes under it
        self.link.watch(request.rid, deliver)
        if not request.resume or request.kv_source_rid:  # a resumed generation is computed here, unless its KV
            self.prompt_kv.expect(request.rid, request)    # moves here live from the worker it froze on
        try:
            await self._call_or_abort(context, Generate(request.rid, list(request.input_ids),
                                                        request.sampling.SerializeToString(), arrived,
                                                        request.lora, span is not None, resume_from_proto(request),
                                                        bool(request.kv_source_rid)))
        except BaseException:  # refused, or cancelled while the engine took it: it must not run on unwatched
            self.link.cast(Abort([request.rid]))
            self.link.unwatch(request.rid)
            self.prompt_kv.abort(request.rid)  # a Prefill call already started for it is cancelled
            traced = self.traced.pop(request.rid, None)
            if traced is not None:  # the engine may have taken it first: its record of the request goes too
                asyncio.ensure_future(self._end_span(request.rid, traced, False, time.monotonic()))
            raise
        self.public_ids[request.rid] = request.public_id  # until `_end`
        return choices_of(request)

    def _message(self, request: pb.GenerateRequest, ready: list[ReqOutput],
                 first: bool) -> tuple[pb.GenerateResponse, set[int]]:
        """The message carrying `ready`, and the choices it finishes."""
        choices = coalesce(ready)
        msg = pb.GenerateResponse(choices=[output_to_proto(c) for c in choices],
                                  prompt_tokens=ready[0].prompt_tokens, cached_tokens=ready[0].cached_tokens)
        prompt_lps = next((c.input_logprobs for c in choices if c.input_logprobs), None)
        if prompt_lps:
            msg.input_logprobs.extend(prompt_logprobs_to_proto(prompt_lps))
        if first:
            self._timings(msg, request.rid, ready[0])
        return msg, {c.index for c in choices if c.finish_reason is not None}

    def _timings(self, msg: pb.GenerateResponse, rid: str, out: ReqOutput) -> None:
        """The first message's account of where the time to first token went on the workers (each part from
        one process's own clock)."""
        now = time.monotonic()
        msg.queue_s, msg.compute_s = out.queue_s, out.compute_s
        msg.host_cached_tokens = out.tier_tokens.get("host", 0)
        msg.storage_cached_tokens = out.tier_tokens.get("storage", 0)
        if out.arrival is not None:
            msg.worker_s = now - out.arrival
        if out.first_token_time is not None:
            msg.handoff_s = now - out.first_token_time
        if rid in self.traced:
            self.traced[rid].first_sent = now
        taken = self.prompt_kv.take_reply(rid)
        if taken is not None:
            timing, pull = taken
            msg.prefill_queue_s, msg.prefill_compute_s = timing.queue_s, timing.compute_s
            msg.transfer_s = timing.transfer_s
            msg.kv_moved_bytes = timing.kv_bytes
            msg.input_logprobs.extend(timing.input_logprobs)  # computed by the prefill worker
            msg.host_cached_tokens, msg.storage_cached_tokens = timing.host_cached_tokens, timing.storage_cached_tokens
            msg.prefill_other_s = max(0.0, timing.total_s - timing.queue_s - timing.compute_s - timing.transfer_s)
            sent, answered, _ = pull
            msg.prefill_call_s = max(0.0, answered - sent - timing.total_s)
            msg.handoff_s = now - answered
            if rid in self.traced:
                self.traced[rid].pull = pull

    async def _fail(self, context, error: str, rid: str) -> None:
        if is_moved(error):  # frozen here for a live move: ABORTED tells the gateway to continue it elsewhere
            self.moving.add(rid)
            await context.abort(grpc.StatusCode.ABORTED, error)
        await context.abort(self.wiring.failure_code, error)

    async def _stalled(self, request: pb.GenerateRequest, context) -> None:
        self._abort_soon(request.rid)
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request made no progress in time")

    def _end(self, request: pb.GenerateRequest, n: int, finished: set[int]) -> None:
        self.link.unwatch(request.rid)
        self.public_ids.pop(request.rid, None)
        traced = self.traced.pop(request.rid, None)
        if traced is not None:
            asyncio.ensure_future(self._end_span(request.rid, traced, len(finished) >= n, time.monotonic()))
        self.prompt_kv.take_reply(request.rid)
        if request.rid in self.moving:  # frozen, its pages kept for the decode worker that continues it
            self.moving.discard(request.rid)
        elif len(finished) < n:  # cancelled by the client, failed or timed out
            self._abort_soon(request.rid)

    async def _end_span(self, rid: str, traced: spans.Traced, finished: bool, end: float) -> None:
        try:
            trace = await self._engine(Trace(rid))
        except (RemoteError, EngineGone, asyncio.TimeoutError):
            trace = None
        spans.end_generate(traced, spans.ReqTrace(**trace) if trace else None, finished, end)

    def _wait_limit(self, first: bool) -> float:
        if first:
            return self.wiring.first_output_wait(self.timeouts.stall, self.timeouts.prefill)
        return self.timeouts.stall

    def _abort_soon(self, rid: str) -> None:
        self.link.cast(Abort([rid]))
        self.prompt_kv.abort(rid)

    # ------------------------------------------------------------ Abort, Health
    async def Abort(self, request, context):
        """One request by its rid; or every generation sent under a client's id, or all of them (what a gateway's
        /abort_request asks of every worker, so that it reaches requests sent by any gateway)."""
        if request.all or request.public_id:
            targets = {rid: public for rid, public in self.public_ids.items()
                       if request.all or public == request.public_id}
        else:
            targets = {request.rid: ""}
        found = await self._call_or_abort(context, Abort(list(targets)))
        for rid in targets:
            self.prompt_kv.abort(rid)
        return pb.AbortReply(found=bool(found), aborted=[targets[rid] for rid in found if targets[rid]])

    async def Health(self, request, context):
        return pb.HealthReply(ok=self.is_ready(), role=self.wiring.role.value, draining=self.calls.draining)
