"""Traces of each request across the services, with OpenTelemetry's SDK and OTLP exporters.

Off unless a service is started with `--enable-trace` or `--otlp-traces-endpoint` (SGLang's names): then the
process installs a tracer provider that batches its spans off the event loop and the engine thread and exports
them to the collector, over OTLP/gRPC for `host:port` (as SGLang) or OTLP/HTTP for an `http(s)://` URL. Spans
are made through OpenTelemetry's global API, so code that traces costs nothing but a no-op call where tracing is
off. The trace context crosses processes as a W3C `traceparent` string in the request messages (a field of
GenerateRequest and PrefillRequest: one GenerateMany stream carries many requests, so metadata per call cannot),
and comes in from a client as its `traceparent` header.

A client's context is not the client's to decide with: its trace id is continued (the client can find its request),
but whether the request is sampled is drawn here at `--otlp-traces-sample-ratio`, and its `tracestate` is dropped,
unless the operator trusts the callers (`--otlp-traces-trust-client-context`). The workers follow the gateway's
decision (their parent is the gateway's span). Prompts and completions in spans (`--otlp-traces-include-content`)
are held to `--otlp-traces-content-max-size` bytes while their spans wait for export (ContentBudget): past it a
span goes without its content, counted.

Engine timings are monotonic seconds (Req.arrival and the like): `wall_ns` turns them into the span times an
exporter wants, so spans are ended from the timestamps the engine already keeps, never by waiting on it. An
unreachable collector costs a warning and the spans it drops (counted through `on_dropped`), never a request.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import re
import threading
import time
import weakref

from pdserve.shared.kv_file_capacity import parse_size

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "localhost:4317"  # OTLP/gRPC on the collector's host: SGLang's default
# W3C trace context: version-traceid-spanid-flags; anything else (or longer) starts a new trace.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
MAX_TRACESTATE = 512  # the spec's limit: a longer tracestate is dropped, the traceparent still continued
DEFAULT_CONTENT_SIZE = "64MiB"  # of prompts and completions awaiting export (--otlp-traces-include-content)
# OpenTelemetry's variables that pick the OTLP protocol of a URL endpoint (grpc, or the default http/protobuf)
PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
INSECURE_ENV = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")

_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()
_state: dict = {"on": False, "include_content": False, "on_dropped": [], "trust_client": False, "ratio": 1.0,
                "content": None}


def add_trace_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing (OpenTelemetry)")
    group.add_argument("--enable-trace", action="store_true",
                       help=f"export a trace of every request to --otlp-traces-endpoint (default {DEFAULT_ENDPOINT})")
    group.add_argument("--otlp-traces-endpoint", default=os.environ.get("PDSERVE_OTLP_TRACES_ENDPOINT") or None,
                       metavar="HOST:PORT|URL",
                       help="where spans go: host:port speaks OTLP/gRPC, an http(s):// URL OTLP/HTTP (e.g. "
                            "http://collector:4318/v1/traces); giving it turns tracing on (default: "
                            "$PDSERVE_OTLP_TRACES_ENDPOINT)")
    group.add_argument("--otlp-traces-sample-ratio", type=_ratio, default=1.0, metavar="R",
                       help="share of requests recorded, 0-1, drawn here even for a client's traceparent unless "
                            "--otlp-traces-trust-client-context")
    group.add_argument("--otlp-traces-trust-client-context", action="store_true",
                       help="a client's traceparent decides whether its request is sampled (its sampled flag "
                            "forces export) and its tracestate goes into the spans (off: only its trace id is "
                            "continued); for callers you trust")
    group.add_argument("--otlp-traces-include-content", action="store_true",
                       help="put prompts and completions into spans (off: traces often leave the cluster)")
    group.add_argument("--otlp-traces-content-max-size", type=_size, default=parse_size(DEFAULT_CONTENT_SIZE, ""),
                       metavar="SIZE",
                       help="bytes of prompts and completions held in spans awaiting export (\"64MB\", \"1GiB\", "
                            f"bytes; default {DEFAULT_CONTENT_SIZE}): past it a span is exported without them, "
                            "counted in pdserve_gateway_trace_content_dropped_total")


def trace_flags(args: argparse.Namespace) -> list[str]:
    """The tracing flags of `args` again, for a child process to trace as its parent does."""
    if not (args.enable_trace or args.otlp_traces_endpoint):
        return []
    flags = ["--otlp-traces-endpoint", args.otlp_traces_endpoint or DEFAULT_ENDPOINT,
             "--otlp-traces-sample-ratio", str(args.otlp_traces_sample_ratio),
             "--otlp-traces-content-max-size", str(args.otlp_traces_content_max_size)]
    flags += ["--otlp-traces-trust-client-context"] if args.otlp_traces_trust_client_context else []
    return flags + (["--otlp-traces-include-content"] if args.otlp_traces_include_content else [])


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a ratio from 0 to 1, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text, "--otlp-traces-content-max-size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def setup_tracing(args: argparse.Namespace, service: str) -> bool:
    """Install this process's tracer provider when its flags ask for tracing; returns whether they do."""
    if not (getattr(args, "enable_trace", False) or getattr(args, "otlp_traces_endpoint", None)):
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    endpoint = args.otlp_traces_endpoint or DEFAULT_ENDPOINT
    try:
        exporter = CountingExporter(_exporter(endpoint))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(TraceIdRatioBased(args.otlp_traces_sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500, export_timeout_millis=5000))
    trace.set_tracer_provider(provider)
    _state.update(on=True, include_content=args.otlp_traces_include_content, provider=provider,
                  trust_client=args.otlp_traces_trust_client_context, ratio=args.otlp_traces_sample_ratio,
                  content=ContentBudget(args.otlp_traces_content_max_size))
    log.info("tracing: spans of %s go to %s (sample ratio %g%s)", service, endpoint, args.otlp_traces_sample_ratio,
             ", clients' trace context trusted" if args.otlp_traces_trust_client_context else "")
    return True


def shutdown_tracing() -> None:
    """Export what is still batched (at most a few seconds), then stop."""
    provider = _state.get("provider")
    if provider is not None:
        provider.shutdown()


def _exporter(endpoint: str):
    """host:port: OTLP/gRPC in plaintext (SGLang's), or over TLS where OTEL_EXPORTER_OTLP_[TRACES_]INSECURE is
    false. A URL: OTLP/HTTP, or OTLP/gRPC where OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL is grpc; either way over TLS
    for https:// and in plaintext for http://. TLS takes the CA (and client certificate) from OpenTelemetry's
    OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE variables, which the exporters read themselves."""
    url = endpoint.startswith(("http://", "https://"))
    protocol = next((os.environ[k] for k in PROTOCOL_ENV if os.environ.get(k)), "http/protobuf").strip().lower()
    if url and protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"{PROTOCOL_ENV[0]} / {PROTOCOL_ENV[1]} must be grpc or http/protobuf, got {protocol!r}")
    if url and protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint, timeout=5)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    # None: the exporter decides from the scheme (https: TLS) or the INSECURE variables; a bare host:port
    # without them stays plaintext, as SGLang's collector endpoint.
    insecure = None if url or any(os.environ.get(k) for k in INSECURE_ENV) else True
    return GrpcExporter(endpoint=endpoint, insecure=insecure, timeout=5)


class CountingExporter:
    """The OTLP exporter, counting the spans of exports that failed: a collector that is down or slow loses
    spans, warned about once per outage, and nothing else."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.dropped = 0
        self._warned = False
        self._lock = threading.Lock()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception as exc:  # the exporter's own errors: the same as a failed export
            log.debug("span export raised: %s", exc)
            result = SpanExportResult.FAILURE
        with self._lock:
            if result == SpanExportResult.SUCCESS:
                self._warned = False
            else:
                self.dropped += len(spans)
                for count in _state["on_dropped"]:
                    count(len(spans))
                if not self._warned:
                    log.warning("tracing: the collector did not take %d spans; dropping spans until it does",
                                len(spans))
                    self._warned = True
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def on_dropped(count) -> None:
    """Have `count(n)` called with the number of spans each failed export drops (a metric's inc)."""
    _state["on_dropped"].append(count)


class ContentBudget:
    """The bytes of prompts and completions that spans hold until they are exported or dropped: a span's share is
    taken when its content is set and given back when the span is gone (exported, or pushed out of a full export
    queue), so a slow or unreachable collector cannot make them grow past `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.dropped = 0
        self.on_dropped: list = []
        self._lock = threading.Lock()

    def set(self, span, attributes: dict) -> bool:
        """Put `attributes` (strings, or lists of them) on `span` if they fit; else count the span's content
        dropped. Returns whether they went on."""
        if not span.is_recording():
            return False
        size = sum(len(t.encode()) for v in attributes.values() for t in (v if isinstance(v, list) else [v]))
        with self._lock:
            fits = self.held + size <= self.limit
            if fits:
                self.held += size
            else:
                self.dropped += 1
        if not fits:
            for count in self.on_dropped:
                count()
            return False
        # The span's copy that waits for export (ReadableSpan) shares its attribute mapping: when that goes, the
        # content is freed, whether exported or pushed out of a full queue.
        span.set_attributes(attributes)
        held_by = getattr(span, "_attributes", None)
        weakref.finalize(span if held_by is None else held_by, self._give_back, size)
        return True

    def _give_back(self, size: int) -> None:
        with self._lock:
            self.held -= size


def set_content(span, attributes: dict) -> bool:
    """--otlp-traces-include-content: the request's text on its span, within the content budget."""
    budget = _state["content"]
    return budget is not None and budget.set(span, attributes)


def on_content_dropped(count) -> None:
    """Have `count()` called for each span that went without its content (a metric's inc)."""
    if _state["content"] is not None:
        _state["content"].on_dropped.append(count)


def enabled() -> bool:
    return _state["on"]


def include_content() -> bool:
    return _state["include_content"]


def tracer():
    from opentelemetry import trace

    return trace.get_tracer("pdserve")


def section(name: str, **attributes):
    """A span around a part of the request's work in this process (nothing when tracing is off)."""
    if not enabled():
        return contextlib.nullcontext()
    return tracer().start_as_current_span(name, attributes={f"pdserve.{k}": v for k, v in attributes.items()})


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the epoch nanoseconds spans are stamped with."""
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


def context_from(traceparent: str | None, tracestate: str | None = None):
    """The remote parent named by a W3C traceparent, or None (no header, or one that is malformed or
    oversized: the request then starts a trace of its own, and is never refused for it). For a parent within
    the deployment (a worker's from the gateway): its sampling decision is followed."""
    if not enabled() or not traceparent or not _TRACEPARENT.match(traceparent.strip().lower()):
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent.strip().lower()}
    if tracestate and len(tracestate) <= MAX_TRACESTATE:
        carrier["tracestate"] = tracestate
    try:
        context = TraceContextTextMapPropagator().extract(carrier)
    except ValueError:
        return None
    from opentelemetry import trace

    return context if trace.get_current_span(context).get_span_context().is_valid else None


def client_context(traceparent: str | None, tracestate: str | None):
    """The remote parent of a request from a client: as `context_from` where the operator trusts the callers
    (--otlp-traces-trust-client-context); else the client's trace and span ids alone, whether it is sampled drawn
    here at the sample ratio, its flags and tracestate left out."""
    if _state["trust_client"]:
        return context_from(traceparent, tracestate)
    context = context_from(traceparent)
    if context is None:
        return None
    from opentelemetry import trace

    theirs = trace.get_current_span(context).get_span_context()
    flags = trace.TraceFlags.SAMPLED if random.random() < _state["ratio"] else trace.TraceFlags.DEFAULT
    ours = trace.SpanContext(theirs.trace_id, theirs.span_id, is_remote=True, trace_flags=trace.TraceFlags(flags))
    return trace.set_span_in_context(trace.NonRecordingSpan(ours))


def traceparent_of(span) -> str:
    """The W3C traceparent naming `span` as the parent of what another process does for it ("" when tracing is
    off or the span is not recorded)."""
    if span is None or not enabled():
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def well_formed(traceparent: str | None) -> str:
    """`traceparent` when it is a W3C traceparent (normalised), else "": what may be stored for later."""
    text = (traceparent or "").strip().lower()
    return text if _TRACEPARENT.match(text) else ""


@contextlib.contextmanager
def batch_item(batch_id: str, custom_id: str, url: str, batch_trace: str):
    """A batch item's span while the gateway runs it (yields its traceparent, "" when tracing is off): a trace
    of its own per item, linked to the request that created the batch."""
    if not enabled():
        yield ""
        return
    from opentelemetry import trace

    links = []
    created = context_from(batch_trace)
    if created is not None:
        links.append(trace.Link(trace.get_current_span(created).get_span_context(), {"pdserve.batch_id": batch_id}))
    with tracer().start_as_current_span("batch item", kind=trace.SpanKind.CLIENT, links=links, attributes={
            "pdserve.batch_id": batch_id, "pdserve.custom_id": custom_id, "url.path": url}) as span:
        yield traceparent_of(span)


def link_current(traceparent: str, attributes: dict | None = None) -> None:
    """Link the current span to the span a W3C traceparent names (a stored Response's trace from its
    continuation): another trace, related rather than parent."""
    context = context_from(traceparent)
    if context is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_link(trace.get_current_span(context).get_span_context(), attributes or {})


def child(name: str, parent_span, start_s: float, end_s: float, attributes: dict | None = None):
    """A finished span under `parent_span`, from monotonic start and end times (the engine's timestamps)."""
    from opentelemetry import trace

    span = tracer().start_span(name, context=trace.set_span_in_context(parent_span),
                               start_time=wall_ns(start_s), attributes=attributes or {})
    span.end(end_time=wall_ns(max(end_s, start_s)))
    return span
