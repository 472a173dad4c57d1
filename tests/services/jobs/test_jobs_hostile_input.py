"""Hostile input to Files and Batches on the real jobs service, directly and through a real gateway: ids that
try to name other Redis keys or other routes, and JSON strings that are not text."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import requests

from jobs_harness import API_KEY, PREFIX, QUIET, chat_line, create_batch, jsonl, upload, wait_batch
from procs import Proc, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def gateway_url(jobs_system, default_model_dir):
    """A real gateway whose /v1/files and /v1/batches go to the shared jobs service (no worker behind it)."""
    port = free_port()
    proc = Proc(f"gateway:{port}", ["gateway", "--model-path", str(default_model_dir), "--port", str(port),
                                    "--worker", f"127.0.0.1:{free_port()}", "--jobs-url", jobs_system.jobs_url]
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
