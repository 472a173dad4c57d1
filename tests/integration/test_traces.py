"""Traces of requests across real processes, exported over OTLP/gRPC to a real receiver on loopback (the OTLP
protobuf service, decoded here): one trace per request, continuing the client's traceparent, with the gateway's,
the decode worker's and the prefill worker's spans correctly parented, the KV transfer among them."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent.parent / "services" / "gateway"))

from harness import start_gateway, start_worker  # noqa: E402

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CHAT = {"model": "default", "max_tokens": 6, "messages": [{"role": "user", "content": "What is the capital of France?"}]}


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: list[str]
    status: int
    start: int
    end: int


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for scope in rs.scope_spans:
                    for s in scope.spans:
                        attrs = {a.key: _value(a.value) for a in s.attributes}
                        self.spans.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                               s.parent_span_id.hex(), attrs, [e.name for e in s.events],
                                               s.status.code, s.start_time_unix_nano, s.end_time_unix_nano))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, services: set[str], timeout: float = 15.0) -> list[Span]:
        """The spans of `trace_id` once every one of `services` has exported its part."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                got = [s for s in self.spans if s.trace_id == trace_id]
            if services <= {s.service for s in got} and _settled(got):
                return got
            time.sleep(0.2)
        raise AssertionError(f"trace {trace_id}: only {[(s.service, s.name) for s in got]}")


def _settled(spans: list[Span]) -> bool:
    """Every span's parent arrived too (a service's spans come in several exports)."""
    ids = {s.span_id for s in spans}
    return all(s.parent_id in ids or s.parent_id in ("", CLIENT_SPAN) for s in spans)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, f"127.0.0.1:{port}"
    server.stop(0)


def by_name(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def chat(gw, traceparent: str | None, body: dict = CHAT) -> requests.Response:
    headers = {"traceparent": traceparent} if traceparent is not None else {}
    return requests.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def ttft_parts(attempt: Span) -> dict[str, float]:
    """The TTFT parts on an attempt's span, each measured on one process's own clock (the network as the
    gateway's wait less the worker's own time); together they account for the TTFT within 5 %."""
    ttft = attempt.attributes["pdserve.ttft_s"]
    parts = {k.split(".")[-1][:-2]: v for k, v in attempt.attributes.items() if k.startswith("pdserve.ttft.")}
    print("TTFT", round(ttft * 1e3, 2), "ms:", {k: round(v * 1e3, 2) for k, v in parts.items()})
    assert set(parts) == {"gateway", "network", "worker_queue", "prefill_call", "prefill_queue", "prefill_compute",
                          "prefill_other", "kv_transfer", "handoff", "other"}
    named = sum(v for k, v in parts.items() if k != "other")
    assert abs(named - ttft) <= 0.05 * ttft, parts  # the named parts add up to the TTFT within 5 %
    return parts


def trace_of(response: requests.Response) -> str:
    return response.headers["traceresponse"].split("-")[1]


def test_a_colocated_chat_is_one_trace_continuing_the_clients(receiver, default_model_dir):
    sink, endpoint = receiver
    worker, addr = start_worker("colocated", str(default_model_dir), "--otlp-traces-endpoint", endpoint)
    gw = start_gateway(default_model_dir, "--worker", addr, "--otlp-traces-endpoint", endpoint)
    try:
        worker.wait_healthy(180)
        gw.proc.wait_healthy(60)
        r = chat(gw, f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
        assert r.status_code == 200, r.text
        assert trace_of(r) == CLIENT_TRACE
        spans = sink.trace(CLIENT_TRACE, {"pdserve-gateway", "pdserve-colocated"})
        server = by_name(spans, "pdserve-gateway", "POST /v1/chat/completions")
        assert server.parent_id == CLIENT_SPAN
        usage = r.json()["usage"]
        assert server.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert server.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert server.attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert server.attributes["gen_ai.request.model"] and server.attributes["http.response.status_code"] == 200
        attempt = by_name(spans, "pdserve-gateway", "generate")
        assert attempt.parent_id == server.span_id and attempt.attributes["pdserve.worker"] == addr
        work = by_name(spans, "pdserve-colocated", "colocated generate")
        assert work.parent_id == attempt.span_id and "first token" in work.events
        parts = {s.name: s for s in spans if s.parent_id == work.span_id}
        assert set(parts) == {"queue", "prefill", "first message", "decode"}
        assert parts["decode"].attributes["pdserve.output_tokens"] == usage["completion_tokens"]
        assert parts["queue"].end <= parts["prefill"].start + 1000 and parts["prefill"].end <= parts["decode"].start + 1000
        assert "pdserve.prompt" not in server.attributes  # no text in spans unless the operator asks
        ttft_parts(attempt)
        assert server.start <= attempt.start <= work.start and attempt.end <= server.end
        assert abs(work.end - attempt.end) < 100e6  # the worker closes its span as it sends the last message

        # The same breakdown without a collector: the status page's flight recorder, and `pdserve debug trace`.
        kept = requests.get(f"{gw.url}/status.json", timeout=10).json()["timelines"]["recent"][0]
        assert kept["request_id"] == r.headers["X-Request-Id"] and kept["trace_id"] == CLIENT_TRACE
        assert kept["ttft_parts"].keys() == {k.split(".")[-1][:-2] for k in attempt.attributes
                                             if k.startswith("pdserve.ttft.")}
        printed = subprocess.run([sys.executable, "-m", "pdserve", "debug", "trace", r.headers["X-Request-Id"],
                                  "--gateway", gw.url], capture_output=True, text=True, timeout=60)
        assert printed.returncode == 0, printed.stderr
        assert f"trace {CLIENT_TRACE}" in printed.stdout and "prefill_compute" in printed.stdout
        assert f"{usage['completion_tokens']} out, finish length" in printed.stdout
        missing = subprocess.run([sys.executable, "-m", "pdserve", "debug", "trace", "no-such-request",
                                  "--gateway", gw.url], capture_output=True, text=True, timeout=60)
        assert missing.returncode == 1 and "404" in missing.stderr and "no-such-request" in missing.stderr

        # A malformed traceparent starts a trace of the gateway's own and is no error; a bad request is traced.
        r = chat(gw, "00-not-a-trace-01")
        assert r.status_code == 200 and trace_of(r) != CLIENT_TRACE
        r = chat(gw, None, {**CHAT, "temperature": -1})
        assert r.status_code == 400
        bad = sink.trace(trace_of(r), {"pdserve-gateway"})
        assert by_name(bad, "pdserve-gateway", "POST /v1/chat/completions").attributes["http.response.status_code"] == 400
    finally:
        gw.proc.stop()
        worker.stop()


def test_a_pd_chat_is_one_trace_over_three_processes_with_the_kv_transfer(receiver, default_model_dir):
    sink, endpoint = receiver
    trace = ("--otlp-traces-endpoint", endpoint)
    prefill, paddr = start_worker("prefill", str(default_model_dir), "--transfer-backend", "tcp", *trace)
    decode, daddr = start_worker("decode", str(default_model_dir), "--transfer-backend", "tcp", "--prefill", paddr,
                                 *trace)
    gw = start_gateway(default_model_dir, "--prefill", paddr, "--decode", daddr, *trace, "--otlp-traces-include-content")
    try:
        for proc in (prefill, decode):
            proc.wait_healthy(180)
        gw.proc.wait_healthy(60)
        # The first request opens the gateway's stream to the pair. A prompt without the chat template: one that
        # shared its system prompt would leave the next so little to compute that decode would compute it itself.
        warm = requests.post(f"{gw.url}/v1/completions", json={"model": "default", "prompt": "Name a color.",
                                                                "max_tokens": 2}, timeout=120)
        assert warm.status_code == 200, warm.text
        r = chat(gw, None)
        assert r.status_code == 200, r.text
        spans = sink.trace(trace_of(r), {"pdserve-gateway", "pdserve-decode", "pdserve-prefill"})
        attempt = by_name(spans, "pdserve-gateway", "generate")
        assert attempt.attributes["pdserve.prefill_worker"] == paddr
        parts = ttft_parts(attempt)
        assert parts["prefill_compute"] > 0 and parts["kv_transfer"] > 0 and parts["prefill_queue"] >= 0
        server = by_name(spans, "pdserve-gateway", "POST /v1/chat/completions")
        assert "capital of France" in server.attributes["pdserve.prompt"]  # --otlp-traces-include-content
        assert server.attributes["pdserve.completions"] == [r.json()["choices"][0]["message"]["content"]]
        work = by_name(spans, "pdserve-decode", "decode generate")
        assert work.parent_id == attempt.span_id
        filled = by_name(spans, "pdserve-prefill", "prefill")
        assert filled.parent_id == work.span_id
        parts = {s.name: s for s in spans if s.parent_id == filled.span_id}
        assert set(parts) == {"prefill queue", "prefill compute", "kv transfer"}
        moved = parts["kv transfer"].attributes
        assert moved["pdserve.pages"] >= 1 and moved["pdserve.bytes"] > 0 and moved["pdserve.transfer_backend"] == "tcp"
        assert parts["prefill compute"].attributes["pdserve.tokens_computed"] == r.json()["usage"]["prompt_tokens"]
        assert {s.name for s in spans if s.parent_id == work.span_id} == {
            "queue", "prefill call start", "prefill call", "prefill", "transfer window close",
            "first tokens to the engine", "first message", "decode"}
    finally:
        gw.proc.stop()
        for proc in (decode, prefill):
            proc.stop()
