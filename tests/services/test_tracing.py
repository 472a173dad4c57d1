"""What services/tracing.py decides before any span leaves: the OTLP transport an endpoint gets (TLS where it is
asked for), and the bound on prompts and completions held in spans awaiting export. The export itself, through
real processes to a real receiver, is tested in tests/integration/test_traces.py."""
from __future__ import annotations

import gc
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

from pdserve.services import tracing
from pdserve.services.tracing import ContentBudget, _exporter

OTEL_VARIABLES = (*tracing.PROTOCOL_ENV, *tracing.INSECURE_ENV, "OTEL_EXPORTER_OTLP_CERTIFICATE",
                  "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE")


@pytest.fixture
def env(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def transport(endpoint: str) -> str:
    exporter = _exporter(endpoint)
    try:
        if type(exporter).__module__.endswith(".http.trace_exporter"):
            return "http"
        return "grpc plaintext" if exporter._insecure else "grpc tls"
    finally:
        exporter.shutdown()


def test_a_grpc_endpoint_uses_tls_where_asked_and_plaintext_only_where_asked(env):
    assert transport("127.0.0.1:4317") == "grpc plaintext"  # SGLang's host:port, as before
    assert transport("https://collector:4318/v1/traces") == "http"  # a URL speaks OTLP/HTTP unless told
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert transport("https://collector:4317") == "grpc tls"
    assert transport("http://collector:4317") == "grpc plaintext"
    env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "false")
    assert transport("collector:4317") == "grpc tls"
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc or http/protobuf, got 'http/json'"):
        _exporter("https://collector:4318/v1/traces")


def test_a_bad_content_size_is_a_clear_error():
    import argparse

    parser = argparse.ArgumentParser()
    tracing.add_trace_flags(parser)
    assert parser.parse_args(["--otlp-traces-content-max-size", "2MiB"]).otlp_traces_content_max_size == 2 << 20
    assert parser.parse_args([]).otlp_traces_content_max_size == 64 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--otlp-traces-content-max-size", "lots"])


class StuckExporter:
    """A collector that takes nothing until released: spans wait in the export queue meanwhile."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.exported: list = []

    def export(self, spans):
        self.entered.set()
        self.release.wait(10)
        self.exported += [s.attributes.get("pdserve.prompt") for s in spans]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def stuck(queue: int):
    """A tracer whose exporter is stuck on a first span, the rest queueing behind it (`queue` at most)."""
    exporter = StuckExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=queue, max_export_batch_size=queue,
                                                   schedule_delay_millis=20))
    tracer = provider.get_tracer("test")
    tracer.start_span("first").end()
    assert exporter.entered.wait(10)
    return exporter, provider, tracer


def request(tracer, budget: ContentBudget, text: str) -> bool:
    span = tracer.start_span("request")
    kept = budget.set(span, {"pdserve.prompt": text, "pdserve.completions": ["é" * 500]})  # + 1,000 bytes
    span.end()
    return kept


def test_content_awaiting_export_is_bounded_in_bytes_and_freed_as_spans_leave():
    exporter, provider, tracer = stuck(queue=8)
    budget = ContentBudget(10_000)
    counted = []
    budget.on_dropped.append(lambda: counted.append(1))
    try:
        kept = [request(tracer, budget, f"{i}" * 3_000) for i in range(5)]  # 4,000 bytes each: two fit
        assert kept == [True, True, False, False, False] and len(counted) == 3 and budget.dropped == 3
        assert budget.held == 8_000
        exporter.release.set()
        provider.force_flush()
        gc.collect()
        assert budget.held == 0  # exported: their content is no longer held
        assert request(tracer, budget, "x" * 3_000)
    finally:
        provider.shutdown()
    prompts = [p for p in exporter.exported if p]
    assert prompts == ["0" * 3_000, "1" * 3_000, "x" * 3_000]  # the others went without their content


def test_spans_a_full_export_queue_pushes_out_give_their_share_back():
    exporter, provider, tracer = stuck(queue=2)
    budget = ContentBudget(10_000)
    try:
        assert request(tracer, budget, "x" * 3_000) and budget.held == 4_000
        for _ in range(4):  # the collector stuck: these push it out of the queue, unexported
            tracer.start_span("other").end()
        gc.collect()
        assert budget.held == 0
    finally:
        exporter.release.set()
        provider.shutdown()
    assert not any(exporter.exported)


def test_a_span_not_sampled_takes_no_share():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    budget = ContentBudget(100)
    span = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test").start_span("request")
    assert not budget.set(span, {"pdserve.prompt": "x" * 1_000}) and budget.held == 0 and budget.dropped == 0
