"""Hostile input to Files and Batches on the real jobs service, directly and through a real gateway: ids that
try to name other Redis keys or other routes, and JSON strings that are not text."""
from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import requests

from jobs_harness import (API_KEY, PREFIX, QUIET, RedisServer, chat_line, client, create_batch, jsonl, start_jobs,
                          upload, wait_batch)
from procs import Proc, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def gateway_url(jobs_system, default_model_dir):
    """A real gateway whose /v1/files and /v1/batches go to the shared jobs service (no worker behind it), with
    one-second body and stream-write timeouts."""
    port = free_port()
    proc = Proc(f"gateway:{port}", ["gateway", "--model-path", str(default_model_dir), "--port", str(port),
                                    "--worker", f"127.0.0.1:{free_port()}", "--jobs-url", jobs_system.jobs_url,
                                    "--body-timeout", "1", "--stream-write-timeout", "1"]
                ).start(QUIET)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # listening is enough: /health stays 503 without a worker
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                assert proc.alive() and time.monotonic() < deadline, proc.tail()
                time.sleep(0.2)
        yield url
    finally:
        proc.stop()


def keys(jobs_system) -> dict:
    r = jobs_system.redis.client()
    return {k: r.type(k) for k in r.keys(PREFIX + "*")}


def test_ids_through_the_gateway_cannot_name_other_keys_or_routes(jobs_system, gateway_url):
    c = jobs_system.client()
    content = jsonl([chat_line("a", "hello")])
    f = upload(c, content)
    before = keys(jobs_system)
    for method, path, param in [
        ("DELETE", f"/v1/files/{f.id}:content", "file_id"),  # would delete the content of file f
        ("DELETE", f"/v1/files/{f.id}%3Acontent", "file_id"),
        ("GET", f"/v1/files/{f.id}%2Fcontent", "file_id"),
        ("GET", "/v1/files/..%2F..%2Fhealth", "file_id"),  # decoded and re-parsed, this was /health
        ("GET", "/v1/batches/..%2Ffiles", "batch_id"),  # ... and this the list of files
        ("POST", "/v1/batches/batch_x/cancel", "batch_id"),
    ]:
        r = requests.request(method, gateway_url + path, headers=AUTH, timeout=10)
        assert r.status_code == 400, (method, path, r.status_code, r.text)
        error = r.json()["error"]
        assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", "invalid_id")
    assert keys(jobs_system) == before
    assert c.files.content(f.id).read() == content
    missing = requests.get(f"{gateway_url}/v1/files/file-{'0' * 24}", headers=AUTH, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "file_id"
    c.files.delete(f.id)


def post_json(jobs_system, path: str, raw: bytes) -> requests.Response:
    return requests.post(jobs_system.jobs_url + path, data=raw, timeout=10,
                         headers={**AUTH, "Content-Type": "application/json"})


def test_lone_surrogates_and_deep_nesting_are_400(jobs_system):
    c = jobs_system.client()
    f = upload(c, jsonl([chat_line("a", "hello")]))
    before = keys(jobs_system)
    create = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for raw, param in [
        (json.dumps({**create, "metadata": {"note": "\ud800"}}).encode(), "metadata"),
        (json.dumps({**create, "metadata": {"\udc00": "x"}}).encode(), "metadata"),
        (json.dumps({**create, "input_file_id": "\ud800"}).encode(), "input_file_id"),
        (b'{"input_file_id": ' + b"[" * 200_000, None),
    ]:
        r = post_json(jobs_system, "/v1/batches", raw)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "Traceback" not in r.text
    assert keys(jobs_system) == before
    c.files.delete(f.id)


def test_a_batch_line_with_a_lone_surrogate_fails_the_batch_at_that_line(jobs_system):
    c = jobs_system.client()
    lines = [json.dumps(chat_line("a", "fine")), json.dumps(chat_line("b", "broken \udfff"))]
    f = upload(c, "\n".join(lines).encode())
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done, _ = wait_batch(c, batch.id)
    assert done.status == "failed"
    assert [(e.line, e.code) for e in done.errors.data] == [(2, "invalid_json")]
    assert "surrogate" in done.errors.data[0].message
    # The same request with a valid pair (an emoji) is text and runs.
    ok, _ = wait_batch(c, create_batch(c, [chat_line("a", "smile \ud83d\ude00")]).id)
    assert ok.status == "completed", ok.errors


def test_a_file_name_that_is_not_utf8_is_stored_as_text(jobs_system):
    boundary = "pdserve-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"").encode() \
        + b"r\xe9sum\xe9.jsonl" + (f"\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n"
                                   f"--{boundary}--\r\n").encode()  # Latin-1 bytes in the header
    r = requests.post(jobs_system.jobs_url + "/v1/files", data=body, timeout=10,
                      headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 200, r.text
    created = r.json()
    assert created["filename"].endswith(".jsonl") and created["bytes"] == 5
    c = jobs_system.client()
    assert c.files.retrieve(created["id"]).filename == created["filename"]
    assert c.files.content(created["id"]).read() == b"hello"
    c.files.delete(created["id"])


def test_an_api_key_header_that_is_not_utf8_is_401(jobs_system):
    r = requests.get(jobs_system.jobs_url + "/v1/files", headers={"Authorization": b"Bearer \xff\xfe"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"


def test_uploads_that_are_not_a_plain_form_are_400_and_leave_nothing(jobs_system):
    before = keys(jobs_system)
    url = jobs_system.jobs_url + "/v1/files"
    nested = (b"--outer\r\nContent-Disposition: form-data; name=\"file\"\r\n"
              b"Content-Type: multipart/mixed; boundary=inner\r\n\r\n--inner\r\n\r\nx\r\n--inner--\r\n"
              b"--outer--\r\n")
    for content_type, body in [("multipart/form-data", b"purpose=batch"),  # no boundary
                               ("multipart/form-data; boundary=b", b"not a form at all"),
                               ("multipart/form-data; boundary=outer", nested)]:
        r = requests.post(url, data=body, headers={**AUTH, "Content-Type": content_type}, timeout=30)
        assert r.status_code == 400, (content_type, r.status_code, r.text)  # were 500s
        assert r.json()["error"]["param"] == "file" and "Traceback" not in r.text
    assert keys(jobs_system) == before


@contextlib.contextmanager
def own_jobs(tmp_path, *flags: str):
    """A jobs service of its own (its own redis-server, no batch worker: a batch stays validating); yields
    (its URL, the redis-server)."""
    redis_server = RedisServer(tmp_path).start()
    jobs = None
    try:
        jobs, url = start_jobs(redis_server.url(), "http://127.0.0.1:1", "--batch-workers", "0", *flags)
        yield url, redis_server
    finally:
        if jobs is not None:
            jobs.stop()
        redis_server.stop()


def stalled_upload(base_url: str) -> bytes:
    """Begin an upload of a 1 MB form, send 70 KB of it and nothing more; the whole answer."""
    host, port = base_url.removeprefix("http://").split(":")
    head = (f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000000\r\n\r\n").encode()
    part = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n' + b"x" * 70_000)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + part)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_batches_past_the_unfinished_limit_are_429_and_leave_nothing(tmp_path):
    # Each unfinished batch queues its whole input file in Redis: one client could otherwise queue any number.
    with own_jobs(tmp_path, "--max-unfinished-batches", "2") as (url, _):
        c = client(url)
        f = upload(c, jsonl([chat_line("a", "hello")]))
        made = [c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
                for _ in range(2)]
        r = requests.post(url + "/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                                     "completion_window": "24h"}, headers=AUTH, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_batches", r.text
        assert "--max-unfinished-batches" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) > 0
        assert sorted(b.id for b in c.batches.list()) == sorted(b.id for b in made)  # the refused one left nothing


def test_an_upload_that_stalls_through_the_gateway_is_408_and_leaves_nothing(jobs_system, gateway_url):
    # Before: the proxy streamed an upload with no bound on waiting for its next byte; the jobs service held
    # the upload's bytes against the quota meanwhile.
    before = keys(jobs_system)
    start = time.monotonic()
    answer = stalled_upload(gateway_url)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 15, answer[:300]
    deadline = time.monotonic() + 10  # the jobs service drops what it had stored once the upload is cut
    while keys(jobs_system) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert keys(jobs_system) == before


def test_an_upload_that_stalls_on_the_jobs_service_itself_is_408_and_leaves_nothing(tmp_path):
    with own_jobs(tmp_path, "--body-idle-seconds", "1") as (url, redis_server):
        assert stalled_upload(url).startswith(b"HTTP/1.1 408")
        r = redis_server.client()
        assert not [k for k in r.keys(PREFIX + "*") if ":content" in k or k.startswith(PREFIX + "file:")]
        assert int(r.get(PREFIX + "usage") or 0) == 0, r.keys(PREFIX + "*")


def test_files_past_the_count_limit_are_507_and_long_names_400(tmp_path):
    # The byte quota alone let any number of empty files (each with an 8 KB name) fill Redis.
    with own_jobs(tmp_path, "--max-files", "2") as (url, _):
        c = client(url)
        kept = [upload(c, b"", name=f"empty{i}.jsonl") for i in range(2)]
        r = requests.post(url + "/v1/files", files={"file": ("third.jsonl", b"")}, data={"purpose": "batch"},
                          headers=AUTH, timeout=30)
        assert r.status_code == 507 and r.json()["error"]["code"] == "files_limit_exceeded", r.text
        assert "--max-files" in r.json()["error"]["message"]
        assert sorted(f.id for f in c.files.list()) == sorted(f.id for f in kept)  # nothing of it stayed
        c.files.delete(kept[0].id)
        assert upload(c, b"", name="again.jsonl").bytes == 0  # room again
        c.files.delete(kept[1].id)
        r = requests.post(url + "/v1/files", files={"file": ("n" * 256, b"x")}, data={"purpose": "batch"},
                          headers=AUTH, timeout=30)
        assert r.status_code == 400 and "255" in r.json()["error"]["message"], r.text
