"""Slow clients on a real gateway and worker: a half-sent request is dropped, a body that does not come is a 408, a
stream whose client stops reading is ended and its admission place freed, and prefill-only calls wait their turn
under the same admission as generations.

On main at b3020c0 (issue 28): a half-sent request was held for up to an hour, a client that stopped reading kept
its admission place for as long as its connection lived, and /v1/score bypassed admission.
"""
from __future__ import annotations

import json
import socket
import time

import requests

from conftest import MAX_RUNNING

LONG = {"text": "Tell me a very long story about a dragon.", "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}


def connect(gw, rcvbuf: int | None = None) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connecting, so the window the client offers stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    return sock


def request_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def open_stream(gw, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A raw streaming /generate request; returns the socket once the first event arrived."""
    sock = connect(gw, rcvbuf)
    payload = json.dumps(body).encode()
    sock.sendall(request_head("/generate", len(payload)) + payload)
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    return sock


def in_flight(gw) -> int:
    info = requests.get(gw.url + "/get_server_info", timeout=10).json()
    return info["internal_states"][0]["running_requests"]


def wait_in_flight(gw, want: int, timeout: float) -> float:
    """Seconds until the gateway counts `want` sequences in flight (fails after `timeout`)."""
    start = time.monotonic()
    while (n := in_flight(gw)) != want:
        assert time.monotonic() - start < timeout, f"{n} sequence(s) still in flight after {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start


def closed_within(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """(what the server sent, seconds) until it closed the connection."""
    sock.settimeout(timeout)
    start, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, socket.timeout):
        raise AssertionError(f"the connection is still open after {timeout} s") from None
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


# ---------------------------------------------------------------- request heads and bodies
def test_a_half_sent_request_head_is_dropped(hostile):
    # --header-timeout 1 on this gateway; aiohttp's default held it for an hour.
    with connect(hostile.strict) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        data, seconds = closed_within(sock, 10)
    assert data == b"" and seconds < 5


def test_an_idle_connection_is_dropped(hostile):
    with connect(hostile.strict) as sock:
        _, seconds = closed_within(sock, 10)
    assert seconds < 5


def test_a_body_that_does_not_come_is_408(hostile):
    with connect(hostile.strict) as sock:
        sock.sendall(request_head("/v1/completions", 1000) + b'{"prompt": "x')
        data, seconds = closed_within(sock, 10)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["code"] == 408 and "--body-timeout" in body["message"]
    assert seconds < 5


def test_a_responses_body_that_does_not_come_is_408_in_openais_envelope(hostile):
    with connect(hostile.strict) as sock:
        sock.sendall(request_head("/v1/responses", 1000) + b'{"input": "x')
        data, _ = closed_within(sock, 10)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == 408 and "--body-timeout" in error["message"]


def test_a_complete_request_is_served_on_the_strict_gateway(hostile):
    r = requests.post(hostile.strict.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- a client that stops reading
def test_a_stream_whose_client_stops_reading_frees_its_place(hostile):
    gw = hostile.strict
    # Every event of a native stream holds the whole output so far with 20 alternatives per token: the
    # socket's buffers fill within a few seconds of generating once the client stops reading.
    body = {**LONG, "return_logprob": True, "top_logprobs_num": 20, "return_text_in_logprobs": True}
    sock = open_stream(gw, body, rcvbuf=4096)
    try:
        assert in_flight(gw) == 1
        seconds = wait_in_flight(gw, 0, timeout=60)  # --stream-write-timeout 1 on this gateway
        assert seconds < 60
        # Its place is free: a full house of new requests is admitted.
        socks = [open_stream(gw, LONG) for _ in range(MAX_RUNNING)]
        for s in socks:
            s.close()
    finally:
        sock.close()
    wait_in_flight(gw, 0, timeout=20)


# ---------------------------------------------------------------- admission of prefill-only calls
def test_score_waits_its_turn_under_admission(hostile):
    gw = hostile.strict  # --max-queued-requests 0: the worker's 4 places and no more
    score = {"query": "Is Paris in France? Answer:", "items": [" yes"], "label_token_ids": [1, 2]}
    socks = [open_stream(gw, LONG) for _ in range(MAX_RUNNING)]
    try:
        r = requests.post(gw.url + "/v1/score", json=score, timeout=30)
        assert r.status_code == 429, r.text
        assert r.json()["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) > 0
    finally:
        for s in socks:
            s.close()
    wait_in_flight(gw, 0, timeout=20)
    r = requests.post(gw.url + "/v1/score", json=score, timeout=60)
    assert r.status_code == 200, r.text
    assert in_flight(gw) == 0
