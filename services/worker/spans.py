"""A worker's spans of one request, under the span of whoever sent it (the gateway, or for a prefill worker the
decode worker): one span for the call, started when it arrives, and its parts made when it ends from the
timestamps the engine keeps on the request (Req.arrival, first_scheduled, first_token_time), so tracing adds
no wait on the engine and nothing to a step.
"""
from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, Status, StatusCode

from pdserve.shared import tracing
from pdserve.shared.config import Role
from pdserve.shared.req import Req


def start(name: str, traceparent: str, attributes: dict):
    """The call's span, a child of `traceparent`; None when tracing is off or the sender traces nothing."""
    parent = tracing.context_from(traceparent)
    if parent is None:
        return None
    return tracing.tracer().start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


def end_generate(span, req: Req | None, role: Role, finished: bool) -> None:
    """A Generate call's parts: the queue, the prompt (computed here, or prefilled by the prefill worker and
    moved: that worker's spans hang below this one), the first token, and the decode."""
    end = time.monotonic()
    if req is not None:
        arrival, scheduled, first = req.arrival, req.first_scheduled, req.first_token_time
        tokens = len(req.output_ids)
        span.set_attributes({"pdserve.prompt_tokens": len(req.input_ids), "pdserve.cached_tokens": req.cached_tokens,
                             "pdserve.output_tokens": tokens})
        if role == Role.DECODE:
            if first is not None:
                tracing.child("prefill and KV transfer", span, arrival, first, {"pdserve.pages": len(req.pages)})
        else:
            if scheduled is not None:
                tracing.child("queue", span, arrival, scheduled)
            if scheduled is not None and first is not None:
                tracing.child("prefill", span, scheduled, first,
                              {"pdserve.tokens_computed": len(req.input_ids) - req.cached_tokens,
                               "pdserve.cached_tokens": req.cached_tokens})
        if first is not None:
            span.add_event("first token", timestamp=tracing.wall_ns(first))
            tracing.child("decode", span, first, end, {"pdserve.output_tokens": tokens})
        if req.finish_reason:
            span.set_attribute("pdserve.finish_reason", req.finish_reason)
    if not finished:
        span.set_status(Status(StatusCode.ERROR, "ended before its choices finished (cancelled, failed or stalled)"))
    span.end(end_time=tracing.wall_ns(end))


def end_prefill(span, req: Req, result, page_bytes: int, backend: str) -> None:
    """A Prefill call's parts, from the engine's own timings of it: queue, compute, and the KV write to the decode
    worker's pages (pages, bytes, backend, rate)."""
    end = time.monotonic()
    queued = req.arrival + result.queue_s
    computed = queued + result.compute_s
    tracing.child("prefill queue", span, req.arrival, queued)
    tracing.child("prefill compute", span, queued, computed,
                  {"pdserve.tokens_computed": len(req.input_ids) - result.cached_tokens,
                   "pdserve.cached_tokens": result.cached_tokens})
    pages = len(req.transfer.dst_pages) if req.transfer is not None else 0
    moved = pages * page_bytes
    rate = moved / result.transfer_s / 1e9 if result.transfer_s > 0 else 0.0
    tracing.child("kv transfer", span, end - result.transfer_s, end,
                  {"pdserve.pages": pages, "pdserve.bytes": moved, "pdserve.transfer_backend": backend,
                   "pdserve.gb_per_s": round(rate, 3)})
    span.end(end_time=tracing.wall_ns(end))


def end_failed(span, reason: str) -> None:
    span.set_status(Status(StatusCode.ERROR, reason))
    span.end()
