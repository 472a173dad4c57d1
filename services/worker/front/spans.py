"""A worker's spans of one request, under the span of whoever sent it (the gateway, or for a prefill worker the
decode worker): one span for the call, started when it arrives, and its parts made when it ends from the
timestamps the engine kept on the request (arrival, first_scheduled, first_token_time: `ReqTrace`, sent by the
engine process afterwards), so tracing adds no wait on the engine and nothing to a step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry.trace import SpanKind, Status, StatusCode

from pdserve.services import tracing
from pdserve.shared.kv_events import cached_by_tier


def start(name: str, traceparent: str, attributes: dict):
    """The call's span, a child of `traceparent`; None when tracing is off or the sender traces nothing."""
    parent = tracing.context_from(traceparent)
    if parent is None:
        return None
    return tracing.tracer().start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


@dataclass
class ReqTrace:
    """What the engine kept of a request (monotonic times; engine_calls.trace_of)."""

    arrival: float
    first_scheduled: float | None
    first_token_time: float | None
    pages_reserved: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    pages: int
    prefill_chunks: list
    decode_steps: int
    drafted_tokens: int
    accepted_tokens: int
    finish_reason: str | None
    dst_pages: int
    tier_tokens: dict  # of cached_tokens, those a lower tier put back for it: {"host": n, "storage": m}


@dataclass
class Traced:
    """A traced Generate call: its span, when its first message left (monotonic), and a decode worker's Prefill
    call."""

    span: object
    first_sent: float | None = None
    pull: list[float] | None = None  # decode: its Prefill call (sent, answered, window closed)


def end_generate(traced: Traced, req: ReqTrace | None, finished: bool, end: float) -> None:
    """A Generate call's parts: the queue, the prompt (computed here, or prefilled by the prefill worker and
    moved: that worker's spans hang below the Prefill call's), the first token, its hand-off to the stream, and
    the decode."""
    span, pull = traced.span, traced.pull
    if req is not None:
        arrival, scheduled, first = req.arrival, req.first_scheduled, req.first_token_time
        tokens = req.output_tokens
        span.set_attributes({"pdserve.prompt_tokens": req.prompt_tokens, "pdserve.cached_tokens": req.cached_tokens,
                             "pdserve.output_tokens": tokens})
        if pull is not None:  # a decode worker's prompt, prefilled by a prefill worker and moved here
            sent, answered, closed = pull
            if req.pages_reserved is not None:
                tracing.child("queue", span, arrival, req.pages_reserved, {"pdserve.pages": req.pages})
                tracing.child("prefill call start", span, req.pages_reserved, sent)
            tracing.child("prefill call", span, sent, answered)
            tracing.child("transfer window close", span, answered, closed)
            if first is not None:
                tracing.child("first tokens to the engine", span, closed, first)
        elif scheduled is not None:  # computed here (colocated, or a decode worker's short next turn)
            tracing.child("queue", span, arrival, scheduled)
            if first is not None:
                chunks(tracing.child("prefill", span, scheduled, first, prompt_attributes(req, req.cached_tokens)),
                       req)
        if first is not None:
            span.add_event("first token", timestamp=tracing.wall_ns(first))
            if traced.first_sent is not None:
                tracing.child("first message", span, first, traced.first_sent)
            tracing.child("decode", span, first, end, {
                "pdserve.output_tokens": tokens, "pdserve.steps": req.decode_steps,
                "pdserve.draft_tokens": req.drafted_tokens, "pdserve.accepted_draft_tokens": req.accepted_tokens})
        if req.finish_reason:
            span.set_attribute("pdserve.finish_reason", req.finish_reason)
    if not finished:
        span.set_status(Status(StatusCode.ERROR, "ended before its choices finished (cancelled, failed or stalled)"))
    span.end(end_time=tracing.wall_ns(end))


def end_prefill(span, req: ReqTrace, result: dict, page_bytes: int, backend: str) -> None:
    """A Prefill call's parts, from the engine's own timings of it: queue, compute, and the KV write to the decode
    worker's pages (pages, bytes, backend, rate)."""
    end = time.monotonic()
    queued = req.arrival + result["queue_s"]
    computed = queued + result["compute_s"]
    transfer_s = result["transfer_s"]
    tracing.child("prefill queue", span, req.arrival, queued)
    chunks(tracing.child("prefill compute", span, queued, computed, prompt_attributes(req, result["cached_tokens"])),
           req)
    pages = req.dst_pages
    moved = pages * page_bytes
    rate = moved / transfer_s / 1e9 if transfer_s > 0 else 0.0
    tracing.child("kv transfer", span, end - transfer_s, end,
                  {"pdserve.pages": pages, "pdserve.bytes": moved, "pdserve.transfer_backend": backend,
                   "pdserve.gb_per_s": round(rate, 3)})
    span.end(end_time=tracing.wall_ns(end))


def prompt_attributes(req: ReqTrace, cached: int) -> dict:
    """What a prompt's computation span says: tokens computed, and those that came from the prefix cache, by
    tier: `pdserve.cached_tokens.<tier>` for each tier that gave some, and `pdserve.cache_tier` the lowest of
    them (device, host, storage)."""
    attributes = {"pdserve.tokens_computed": req.prompt_tokens - cached, "pdserve.cached_tokens": cached,
                  "pdserve.prefill_chunks": len(req.prefill_chunks)}
    if not cached:
        return attributes
    by_tier = {tier: n for tier, n in cached_by_tier(cached, req.tier_tokens).items() if n}
    attributes |= {f"pdserve.cached_tokens.{tier}": n for tier, n in by_tier.items()}
    return attributes | {"pdserve.cache_tier": list(by_tier)[-1]}  # the lowest: tiers go device, host, storage


def chunks(parent, req: ReqTrace) -> None:
    """One span per engine step that computed a chunk of the prompt, with its tokens, under `parent`."""
    for number, (start, end, tokens) in enumerate(req.prefill_chunks, 1):
        tracing.child(f"chunk {number}", parent, start, end, {"pdserve.tokens": tokens})


def end_failed(span, reason: str) -> None:
    span.set_status(Status(StatusCode.ERROR, reason))
    span.end()
