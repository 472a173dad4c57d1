"""What one generation leaves for the people who run the gateway: a span per attempt on a worker pair (the
workers' spans hang under it), its time to first token in named parts (/metrics, and the span), and its
timeline for the flight recorder (services/gateway/timelines.py). Kept apart from Generation, whose job is the
tokens: the record reads it as an `Outcome`, the few counts and texts it reports, and never imports it."""
from __future__ import annotations

import time
from typing import Protocol, Sequence

from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace import get_current_span as current_span

from pdserve.proto import worker_pb2 as pb
from pdserve.services import tracing
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.timelines import Timeline
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers.job import Job
from pdserve.services.gateway.workers.live_move import LiveMove
from pdserve.services.gateway.workers.pool import Worker
from pdserve.services.gateway.workers.router import Pair
from pdserve.shared.logs import REQUEST_ID

CONTENT_CHARS = 65536  # of a prompt or completion in a span, with --otlp-traces-include-content


class ChoiceOutcome(Protocol):
    finished: bool
    finish_reason: str | None
    output_ids: list[int]


class Outcome(Protocol):
    """What the record reads of the generation it follows (a Generation is one)."""

    job: Job
    tokenizer: ModelTokenizer
    prompt_tokens: int
    cached_tokens: int

    @property
    def choices(self) -> Sequence[ChoiceOutcome]: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def e2e_latency(self) -> float: ...


def names(pair: Pair) -> str:
    return " + ".join(f"{w.role} {w.address}" for w in pair.workers)


class GenerationRecord:
    def __init__(self, job: Job, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        trace = current_span().get_span_context()  # the request's server span (app.observe), when traced
        self.timeline = Timeline(REQUEST_ID.get() or "", job.rid, job.public_id,
                                 f"{trace.trace_id:032x}" if trace.is_valid else "", time.time())
        self.span = None
        self.sent = 0.0

    def attempt(self, pair: Pair, number: int, resumed: bool, request: pb.GenerateRequest) -> None:
        """An attempt starts on `pair`: its span, whose context goes to the worker in `request`."""
        self.sent = time.perf_counter()
        self.timeline.workers = names(pair)
        if not tracing.enabled():
            return
        self.span = tracing.tracer().start_span("generate", attributes={
            "pdserve.worker": pair.generate.address,
            "pdserve.prefill_worker": pair.prefill.address if pair.prefill is not None else "",
            "pdserve.attempt": number, "pdserve.resumed": resumed, "pdserve.rid": request.rid,
            "pdserve.route": pair.why})
        request.traceparent = tracing.traceparent_of(self.span)

    def first_message(self, msg: pb.GenerateResponse, start: float) -> None:
        """Where the time to first token went (`start`: the generation's), from the gateway's clock and the
        workers' reports of their own parts, each from one process's clock: the network is the gateway's wait
        less the worker's own time."""
        now = time.perf_counter()
        ttft = now - start
        parts = {"gateway": self.sent - start, "network": max(0.0, now - self.sent - msg.worker_s),
                 "worker_queue": msg.queue_s, "prefill_call": msg.prefill_call_s, "prefill_queue": msg.prefill_queue_s,
                 "prefill_compute": msg.prefill_compute_s or msg.compute_s, "prefill_other": msg.prefill_other_s,
                 "kv_transfer": msg.transfer_s, "handoff": msg.handoff_s}
        # What no part names: the workers' own time that their parts miss (0 when they account for all of it).
        parts["other"] = max(0.0, ttft - sum(parts.values()))
        self.timeline.ttft_s, self.timeline.ttft_parts = ttft, parts
        for part, seconds in parts.items():
            self.metrics.ttft_parts.labels(part).observe(seconds)
        if self.span is not None:
            self.span.set_attribute("pdserve.ttft_s", ttft)
            self.span.set_attributes({f"pdserve.ttft.{part}_s": seconds for part, seconds in parts.items()})

    def failed(self, step: str, reason: str, tokens: int, workers: str) -> None:
        """An attempt failed; `step` is what follows: retry, migrate, restart, or failed (the request ends)."""
        self.timeline.events.append(f"{step} after {tokens} tokens on {workers}: {reason}")
        current_span().add_event(step, {"pdserve.reason": reason, "pdserve.workers": workers,
                                        "pdserve.tokens": tokens})

    def moved(self, move: LiveMove, dest: Worker, kv_bytes: int) -> None:
        """A live move completed (its first output came from `dest`): counted, timed, and an event of the trace."""
        seconds, to = time.perf_counter() - move.since, dest.address
        move.source.moved_out += 1
        dest.moved_in += 1
        self.metrics.migrations.labels("live", move.reason).inc()
        self.metrics.migration_seconds.labels("live").observe(seconds)
        self.metrics.migration_bytes.observe(kv_bytes)
        self.timeline.events.append(f"moved live ({move.reason}) from {move.source.address} to {to} in "
                                    f"{seconds * 1000:.0f} ms, {kv_bytes} bytes of KV")
        current_span().add_event("migration", {"pdserve.kind": "live", "pdserve.reason": move.reason,
                                               "pdserve.from": move.source.address, "pdserve.to": to,
                                               "pdserve.seconds": seconds, "pdserve.kv_bytes": kv_bytes})

    def end_attempt(self, gen: Outcome, failure: str | None) -> None:
        """The attempt's span ends; the request's usage goes on the server span (GenAI conventions)."""
        span, self.span = self.span, None
        if span is None:
            return
        tokens = gen.completion_tokens
        span.set_attribute("gen_ai.usage.output_tokens", tokens)
        if failure is not None or not all(c.finished for c in gen.choices):
            span.set_status(Status(StatusCode.ERROR, failure or "the attempt ended before its choices finished"))
        span.end()
        server = current_span()
        server.set_attributes({"gen_ai.usage.input_tokens": gen.prompt_tokens, "gen_ai.usage.output_tokens": tokens,
                               "pdserve.cached_tokens": gen.cached_tokens})
        reasons = [c.finish_reason for c in gen.choices if c.finish_reason]
        if reasons:
            server.set_attribute("gen_ai.response.finish_reasons", reasons)
        if tracing.include_content() and server.is_recording():  # the operator asked for the text
            tracing.set_content(server, {
                "pdserve.prompt": gen.tokenizer.decode(gen.job.input_ids)[:CONTENT_CHARS],
                "pdserve.completions": [gen.tokenizer.decode(c.output_ids)[:CONTENT_CHARS] for c in gen.choices]})

    def finish(self, gen: Outcome) -> Timeline:
        """The generation's timeline, complete now that it has ended (Backend records it)."""
        t = self.timeline
        t.total_s, t.prompt_tokens, t.cached_tokens = gen.e2e_latency, gen.prompt_tokens, gen.cached_tokens
        t.output_tokens = gen.completion_tokens
        t.finish_reasons = [c.finish_reason for c in gen.choices if c.finish_reason]
        return t
