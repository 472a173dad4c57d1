"""Traces of requests across real processes, exported over OTLP/gRPC to a real receiver on loopback (the OTLP
protobuf service, decoded here): one trace per request, continuing the client's traceparent, with the gateway's,
the decode worker's and the prefill worker's spans correctly parented, the KV transfer among them."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent.parent / "services" / "gateway"))
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from harness import start_gateway, start_worker, wait_listening  # noqa: E402
from procs import free_port  # noqa: E402
from otlp_receiver import Span, serve  # noqa: E402

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CHAT = {"model": "default", "max_tokens": 6,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


@pytest.fixture(scope="module")
def receiver():
    server, sink, endpoint = serve()
    yield sink, endpoint
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


@pytest.fixture(scope="module")
def colocated(receiver, default_model_dir):
    """A colocated worker and its gateway, both traced to the receiver: (worker, its address, gateway)."""
    _, endpoint = receiver
    worker, addr = start_worker("colocated", str(default_model_dir), "--otlp-traces-endpoint", endpoint)
    gw = start_gateway(default_model_dir, "--worker", addr, "--otlp-traces-endpoint", endpoint)
    try:
        worker.wait_healthy(180)
        gw.proc.wait_healthy(60)
        yield worker, addr, gw
    finally:
        gw.proc.stop()
        worker.stop()


def test_a_colocated_chat_is_one_trace_continuing_the_clients(receiver, colocated):
    sink, _ = receiver
    _, addr, gw = colocated
    r = chat(gw, f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert r.status_code == 200, r.text
    assert trace_of(r) == CLIENT_TRACE
    spans = sink.trace(CLIENT_TRACE, {"pdserve-gateway", "pdserve-colocated"}, outside={CLIENT_SPAN})
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
    assert parts["decode"].attributes["pdserve.steps"] == usage["completion_tokens"] - 1  # after the first
    assert parts["decode"].attributes["pdserve.draft_tokens"] == 0  # no speculation on this worker
    steps = [s for s in spans if s.parent_id == parts["prefill"].span_id]
    assert [s.name for s in steps] == ["chunk 1"] and steps[0].attributes["pdserve.tokens"] == usage["prompt_tokens"]
    assert attempt.attributes["pdserve.route"] == "least loaded, no known prefix"  # the first of its prompt
    assert parts["queue"].end <= parts["prefill"].start + 1000
    assert parts["prefill"].end <= parts["decode"].start + 1000
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

    # A prefill-only call (scoring, as embeddings) goes through the worker's Encode, traced the same way.
    scored = requests.post(f"{gw.url}/v1/score", json={"model": "default", "query": "Is Paris in France?",
                                                       "items": [" yes", " no"], "label_token_ids": [1]},
                           timeout=120)
    assert scored.status_code == 200, scored.text
    encode = sink.trace(trace_of(scored), {"pdserve-gateway", "pdserve-colocated"})
    asked = by_name(encode, "pdserve-gateway", "encode")
    assert asked.parent_id == by_name(encode, "pdserve-gateway", "POST /v1/score").span_id
    served = by_name(encode, "pdserve-colocated", "encode")
    assert served.parent_id == asked.span_id and served.attributes["pdserve.inputs"] == 2

    # A stored Response's continuation is a trace of its own, linked to the one that made the Response.
    first = requests.post(f"{gw.url}/v1/responses",
                          json={"model": "default", "input": "Hi", "max_output_tokens": 3}, timeout=120)
    then = requests.post(f"{gw.url}/v1/responses", json={"model": "default", "input": "And then?",
                                                         "max_output_tokens": 3,
                                                         "previous_response_id": first.json()["id"]}, timeout=120)
    assert first.status_code == then.status_code == 200, then.text
    made = by_name(sink.trace(trace_of(first), {"pdserve-gateway"}), "pdserve-gateway", "POST /v1/responses")
    later = by_name(sink.trace(trace_of(then), {"pdserve-gateway"}), "pdserve-gateway", "POST /v1/responses")
    assert later.trace_id != made.trace_id and later.links == [(made.trace_id, made.span_id)]

    # A malformed traceparent starts a trace of the gateway's own and is no error, nor is an oversized
    # tracestate (dropped, the traceparent still continued); a bad request is traced.
    r = chat(gw, "00-not-a-trace-01")
    assert r.status_code == 200 and trace_of(r) != CLIENT_TRACE
    other = "0af7651916cd43dd8448eb211c80319c"
    r = requests.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=120,
                      headers={"traceparent": f"00-{other}-{CLIENT_SPAN}-01", "tracestate": "k=" + "v" * 5000})
    assert r.status_code == 200 and trace_of(r) == other
    r = chat(gw, None, {**CHAT, "temperature": -1})
    assert r.status_code == 400
    bad = sink.trace(trace_of(r), {"pdserve-gateway"})
    refused = by_name(bad, "pdserve-gateway", "POST /v1/chat/completions")
    assert refused.attributes["http.response.status_code"] == 400

    # A client's tracestate stays out of the spans: the gateway does not trust its callers unless told.
    third = "5b8aa5a2d2c872e8321cf37308d69df2"
    r = requests.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=120,
                      headers={"traceparent": f"00-{third}-{CLIENT_SPAN}-01", "tracestate": "congo=t61rcWkgMzE"})
    assert r.status_code == 200 and trace_of(r) == third
    assert {s.trace_state for s in sink.trace(third, {"pdserve-gateway", "pdserve-colocated"},
                                              outside={CLIENT_SPAN})} == {""}


def trace_records(worker) -> tuple[float, float]:
    """The worker's traced generations whose spans are open, and the requests its engine keeps timings of."""
    text = requests.get(worker.health_url.replace("/health", "/metrics"), timeout=10).text
    found = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
             if line.startswith(("pdserve_worker_traced_generations", "pdserve_worker_engine_trace_records"))}
    return found["pdserve_worker_traced_generations"], found["pdserve_worker_engine_trace_records"]


def hang_up_after(gw, delay_s: float, number: int) -> None:
    """A streamed chat whose client goes away `delay_s` after sending it (before any answer, or mid-stream)."""
    body = json.dumps({**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True,
                       "messages": [{"role": "user", "content": f"Tell story {number}. " * (1 + number % 5)}]})
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        time.sleep(delay_s)


def test_cancelled_streams_leave_no_trace_records(colocated):
    worker, _, gw = colocated
    r = stream_chat(gw, 200)
    lines = r.iter_lines()  # held: a generator dropped closes the stream
    next(x for x in lines if x.startswith(b"data: {"))
    assert trace_records(worker) == (1, 1)  # a traced stream in progress: its span and the engine's record
    r.close()
    # Clients that go away at every stage: before the worker has the request, while the engine takes it (the
    # worker's call cancelled: its engine record was kept for good), mid-stream.
    delays = [0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 0.8] * 3
    threads = [threading.Thread(target=hang_up_after, args=(gw, delay, n)) for n, delay in enumerate(delays)]
    for thread in threads:
        thread.start()
        time.sleep(0.01)
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 15
    while trace_records(worker) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trace_records(worker) == (0, 0)


def test_a_pd_chat_is_one_trace_over_three_processes_with_the_kv_transfer(receiver, default_model_dir):
    sink, endpoint = receiver
    trace = ("--otlp-traces-endpoint", endpoint)
    prefill, paddr = start_worker("prefill", str(default_model_dir), "--transfer-backend", "tcp", *trace)
    decode, daddr = start_worker("decode", str(default_model_dir), "--transfer-backend", "tcp", "--prefill", paddr,
                                 *trace)
    gw = start_gateway(default_model_dir, "--prefill", paddr, "--decode", daddr, *trace,
                       "--otlp-traces-include-content", "--otlp-traces-content-max-size", "2KB")
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
        assert [s.name for s in spans if s.parent_id == parts["prefill compute"].span_id] == ["chunk 1"]
        assert attempt.attributes["pdserve.route"].startswith("prefill: ")
        assert {s.name for s in spans if s.parent_id == work.span_id} == {
            "queue", "prefill call start", "prefill call", "prefill", "transfer window close",
            "first tokens to the engine", "first message", "decode"}

        # Content past --otlp-traces-content-max-size: the span goes without it, counted.
        assert content_dropped(gw) == 0
        long = {**CHAT, "messages": [{"role": "user", "content": "Name a color. " * 200}]}  # 2,800 bytes
        r = chat(gw, None, long)
        assert r.status_code == 200, r.text
        server = by_name(sink.trace(trace_of(r), {"pdserve-gateway", "pdserve-decode", "pdserve-prefill"}),
                         "pdserve-gateway", "POST /v1/chat/completions")
        assert "pdserve.prompt" not in server.attributes and "pdserve.completions" not in server.attributes
        assert server.attributes["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
        assert content_dropped(gw) == 1
    finally:
        gw.proc.stop()
        for proc in (decode, prefill):
            proc.stop()


def stream_chat(gw, max_tokens: int) -> requests.Response:
    body = {**CHAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    return requests.post(f"{gw.url}/v1/chat/completions", json=body, stream=True, timeout=120)


def test_a_migration_and_an_abort_show_in_their_traces(receiver, default_model_dir):
    sink, endpoint = receiver
    trace = ("--otlp-traces-endpoint", endpoint)
    prefill, paddr = start_worker("prefill", str(default_model_dir), "--transfer-backend", "tcp", *trace)
    workers = dict(start_worker("decode", str(default_model_dir), "--transfer-backend", "tcp", "--prefill", paddr,
                                *trace)[::-1] for _ in range(2))
    gw = start_gateway(default_model_dir, "--prefill", paddr, *[f for a in workers for f in ("--decode", a)], *trace)
    workers[paddr] = prefill
    try:
        for proc in workers.values():
            proc.wait_healthy(180)
        gw.proc.wait_healthy(60)
        deadline = time.monotonic() + 30  # the gateway's own checks see both decode workers (it serves with one)
        while not all(w["healthy"] for w in requests.get(f"{gw.url}/status.json", timeout=10).json()["workers"][
                "decode"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        # A stream whose worker is killed mid-way moves to the other worker: one trace, two attempts.
        r = stream_chat(gw, 160)
        lines = r.iter_lines()
        chunks = [line for line, _ in zip((x for x in lines if x.startswith(b"data: {")), range(10))]
        status = requests.get(f"{gw.url}/status.json", timeout=10).json()
        busy = next(w["address"] for w in status["workers"]["decode"] if w["in_flight"])
        workers[busy].popen.kill()  # the decode worker streaming it
        chunks += [line for line in lines if line.startswith(b"data: {")]
        assert b'"finish_reason": "length"' in chunks[-1]  # the stream went on to its end, no error
        # The killed worker's spans not exported yet died with it: the rest of the trace is all there is.
        spans = sink.trace(trace_of(r), {"pdserve-gateway", "pdserve-decode", "pdserve-prefill"}, complete=False)
        server = by_name(spans, "pdserve-gateway", "POST /v1/chat/completions")
        assert "migrate" in server.events
        attempts = sorted((s for s in spans if s.name == "generate"), key=lambda s: s.start)
        assert [a.attributes["pdserve.worker"] for a in attempts][0] == busy and len(attempts) == 2
        assert attempts[0].status == 2 and attempts[1].attributes["pdserve.resumed"]  # 2: STATUS_CODE_ERROR
        survivor = attempts[1].attributes["pdserve.worker"]
        assert by_name(spans, "pdserve-decode", "decode generate").parent_id == attempts[1].span_id
        kept = requests.get(f"{gw.url}/status.json", timeout=10).json()["timelines"]["recent"][0]
        assert kept["events"] and kept["events"][0].startswith("migrate") and survivor in kept["workers"]

        # A client that goes away mid-stream: its attempt and the worker's span end in error.
        r = stream_chat(gw, 400)
        next(x for x in r.iter_lines() if x.startswith(b"data: {"))
        r.close()
        spans = sink.trace(trace_of(r), {"pdserve-gateway", "pdserve-decode"})
        work = by_name(spans, "pdserve-decode", "decode generate")
        assert work.status == 2 and work.attributes["pdserve.output_tokens"] < 400
        assert by_name(spans, "pdserve-gateway", "generate").status == 2
    finally:
        gw.proc.stop()
        for proc in workers.values():
            proc.stop()


def test_batch_items_are_traces_linked_to_the_request_that_made_the_batch(receiver, tmp_path):
    import openai
    from integration.test_up_e2e import Up

    sink, endpoint = receiver
    up = Up(tmp_path, "--colocated", "--otlp-traces-endpoint", endpoint)  # one flag: every service traces
    try:
        base_url, _ = up.wait_ready()
        client = openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=120)
        lines = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "default", "max_tokens": 3,
                                             "messages": [{"role": "user", "content": f"Hi {i}"}]}}) + "\n"
                        for i in range(2))
        uploaded = client.files.create(file=("batch.jsonl", lines.encode()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status != "completed" and time.monotonic() < deadline:
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 2, batch
        made = next(s for s in wait_for(sink, lambda s: s.name == "POST /v1/batches"))
        items = wait_for(sink, lambda s: s.name == "batch item", count=2)
        assert {s.attributes["pdserve.custom_id"] for s in items} == {"q0", "q1"}
        for item in items:
            assert item.service == "pdserve-batch-worker" and item.attributes["pdserve.batch_id"] == batch.id
            assert item.links == [(made.trace_id, made.span_id)] and item.trace_id != made.trace_id
            served = sink.trace(item.trace_id, {"pdserve-batch-worker", "pdserve-gateway", "pdserve-colocated"})
            assert by_name(served, "pdserve-gateway", "POST /v1/chat/completions").parent_id == item.span_id
    finally:
        up.close()


def wait_for(sink, test, count: int = 1, timeout: float = 15.0) -> list[Span]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sink.lock:
            found = [s for s in sink.spans if test(s)]
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{count} spans expected, {len(found)} arrived")


def test_otlp_over_http_and_an_unreachable_collector_that_costs_only_dropped_spans(default_model_dir):
    from otlp_receiver import serve_http

    server, sink, url = serve_http()
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    over_http = start_gateway(default_model_dir, "--worker", nowhere, "--otlp-traces-endpoint", url)
    unreachable = start_gateway(default_model_dir, "--worker", nowhere, "--otlp-traces-endpoint", nowhere)
    try:
        for gw in (over_http, unreachable):
            wait_listening(gw)
        r = chat(over_http, None)
        assert r.status_code == 503  # no worker: refused, and traced all the same
        refused = by_name(sink.trace(trace_of(r), {"pdserve-gateway"}), "pdserve-gateway",
                          "POST /v1/chat/completions")
        assert refused.attributes["http.response.status_code"] == 503 and refused.status == 2
        started = time.monotonic()
        assert chat(unreachable, None).status_code == 503
        assert time.monotonic() - started < 5  # the collector is never waited for
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and dropped(unreachable) == 0:
            time.sleep(0.5)
        assert dropped(unreachable) >= 1 and "the collector did not take" in unreachable.proc.tail(200)
    finally:
        for gw in (over_http, unreachable):
            gw.proc.stop()
        server.shutdown()


def content_dropped(gw) -> float:
    text = requests.get(f"{gw.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve_gateway_trace_content_dropped_total"))


def dropped(gw) -> float:
    text = requests.get(f"{gw.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve_gateway_trace_spans_dropped_total"))


@pytest.fixture(scope="module")
def tls_receiver(tmp_path_factory):
    """A receiver that takes spans over TLS only, its certificate self-signed for 127.0.0.1: (spans, https URL,
    the certificate's file, for OTEL_EXPORTER_OTLP_CERTIFICATE)."""
    from otlp_receiver import serve

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the receiver's certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=pdserve",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server, sink, address = serve(tls=(key.read_bytes(), cert.read_bytes()))
    yield sink, f"https://{address}", cert
    server.stop(0)


def test_a_clients_sampled_flag_forces_no_export_unless_trusted_and_https_is_tls(receiver, tls_receiver,
                                                                                 default_model_dir, monkeypatch):
    """Sample ratio 0: a client's traceparent with its sampled flag, and tracestate, authorised or refused 401."""
    sink, endpoint = receiver
    secure_sink, url, cert = tls_receiver
    nowhere = f"127.0.0.1:{free_port()}"
    flags = ("--worker", nowhere, "--api-key", "sk-traces", "--otlp-traces-sample-ratio", "0")
    with monkeypatch.context() as env:  # OTLP/gRPC to an https:// URL, the CA from OpenTelemetry's variable
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        env.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(cert))
        trusting = start_gateway(default_model_dir, *flags, "--otlp-traces-endpoint", url,
                                 "--otlp-traces-trust-client-context")
    default = start_gateway(default_model_dir, *flags, "--otlp-traces-endpoint", endpoint)
    traces = {}
    try:
        for name, gw in (("trusting", trusting), ("default", default)):
            wait_listening(gw)
            for kind, key in (("authorised", "sk-traces"), ("refused", "wrong")):
                trace = f"{len(traces) + 1:032x}"
                r = requests.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=60,
                                  headers={"Authorization": f"Bearer {key}", "tracestate": "congo=t61rcWkgMzE",
                                           "traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
                assert r.status_code == (503 if kind == "authorised" else 401), r.text
                assert trace_of(r) == trace  # the client's trace id is continued either way, for correlation
                traces[name, kind] = trace
        for kind, status in (("authorised", 503), ("refused", 401)):
            span = by_name(secure_sink.trace(traces["trusting", kind], {"pdserve-gateway"}, outside={CLIENT_SPAN}),
                           "pdserve-gateway", "POST /v1/chat/completions")
            assert span.attributes["http.response.status_code"] == status and span.trace_state == "congo=t61rcWkgMzE"
    finally:
        for gw in (trusting, default):
            gw.proc.stop()  # what is still batched is exported as it stops
    assert not [s for s in sink.spans if s.trace_id in (traces["default", "authorised"], traces["default", "refused"])]
