"""A real OTLP/gRPC trace receiver on loopback (OpenTelemetry's own protobuf service), decoding what it gets:
what the tracing benchmark exports to, and what the trace tests read their spans from."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


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
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id) of each linked span
    trace_state: str = ""  # W3C tracestate


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    exports: int = 0

    def Export(self, request, context):
        with self.lock:
            self.exports += 1
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for scope in rs.scope_spans:
                    for s in scope.spans:
                        attrs = {a.key: _value(a.value) for a in s.attributes}
                        self.spans.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                               s.parent_span_id.hex(), attrs, [e.name for e in s.events],
                                               s.status.code, s.start_time_unix_nano, s.end_time_unix_nano,
                                               [(k.trace_id.hex(), k.span_id.hex()) for k in s.links],
                                               s.trace_state))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, services: set[str], timeout: float = 15.0,
              outside: set[str] = frozenset(), complete: bool = True) -> list[Span]:
        """The spans of `trace_id` once every one of `services` has exported its part and every span's parent
        has arrived too (`outside`: parent ids from beyond the receiver, a client's span). `complete=False`: a
        process of the trace was killed, and the spans it had not exported yet never come: wait for `services`
        and a second more."""
        deadline = time.monotonic() + timeout
        got: list[Span] = []
        while time.monotonic() < deadline:
            with self.lock:
                got = [s for s in self.spans if s.trace_id == trace_id]
            ids = {s.span_id for s in got} | set(outside) | {""}
            if services <= {s.service for s in got}:
                if not complete:
                    time.sleep(1.0)
                    with self.lock:
                        return [s for s in self.spans if s.trace_id == trace_id]
                if all(s.parent_id in ids for s in got):
                    return got
            time.sleep(0.2)
        raise AssertionError(f"trace {trace_id}: only {[(s.service, s.name) for s in got]}")


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def serve(tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.Server, Receiver, str]:
    """A started receiver: (its server, to stop; its spans; its host:port). `tls`: (private key, certificate) in
    PEM, to take spans over TLS only."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([tls]))
    server.start()
    return server, sink, f"127.0.0.1:{port}"


def serve_http() -> tuple[object, Receiver, str]:
    """The same receiver over OTLP/HTTP (protobuf bodies POSTed to /v1/traces): (its server, to shut down; its
    spans; its URL)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sink = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            reply = sink.Export(request, None).SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, sink, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
