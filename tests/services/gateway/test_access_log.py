"""The gateway's access log and request ids: a JSON line per request under its id, the id in X-Request-Id,
request bodies with --log-requests, and never the API key (a real gateway process, its worker down)."""
from __future__ import annotations

import json
import re
import time

import pytest
import requests

from harness import free_port, start_gateway, wait_listening

KEY = "sk-access-log-secret-7f3a"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "marker-in-the-body"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gateway(default_model_dir):
    gw = start_gateway(default_model_dir, "--worker", f"127.0.0.1:{free_port()}", "--api-key", KEY,
                       "--log-format", "json", "--log-requests")
    try:
        yield wait_listening(gw)
    finally:
        gw.proc.stop()


def log_entries(gw, until: str, timeout: float = 10.0) -> list[dict]:
    """The gateway's JSON log lines, once one of them holds `until`."""
    deadline = time.monotonic() + timeout
    while True:
        text = gw.proc.log_path.read_text(errors="replace")
        if until in text or time.monotonic() > deadline:
            return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        time.sleep(0.1)


def test_each_request_gets_an_id_an_access_line_and_its_body_logged_without_the_key(gateway):
    auth = {"Authorization": f"Bearer {KEY}"}
    kept = requests.post(gateway.base + "/chat/completions", json=CHAT, timeout=30,
                         headers={**auth, "X-Request-Id": "trace-42.a"})
    assert kept.status_code == 503 and kept.headers["X-Request-Id"] == "trace-42.a"
    made = requests.post(gateway.base + "/chat/completions", json=CHAT, timeout=30,
                         headers={**auth, "X-Request-Id": "not a safe id"})
    new_id = made.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", new_id)
    refused = requests.post(gateway.base + "/chat/completions", json={**CHAT, "user": "unauthorised-body"},
                            timeout=30)
    assert refused.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["X-Request-Id"])
    assert len({kept.headers["X-Request-Id"], new_id, refused.headers["X-Request-Id"]}) == 3

    entries = log_entries(gateway, refused.headers["X-Request-Id"])
    access = {e["request_id"]: e for e in entries if e["logger"] == "pdserve.access"}
    line = access["trace-42.a"]
    assert (line["method"], line["path"], line["status"], line["level"]) == ("POST", "/v1/chat/completions", 503,
                                                                            "INFO")
    assert line["duration_ms"] >= 0 and line["message"].startswith("POST /v1/chat/completions 503 ")
    assert access[new_id]["status"] == 503 and access[refused.headers["X-Request-Id"]]["status"] == 401
    bodies = [e for e in entries if e["logger"] == "pdserve.requests"]
    assert {e["request_id"] for e in bodies} == {"trace-42.a", new_id}  # not the request refused for its key
    assert all(e["level"] == "DEBUG" and "marker-in-the-body" in e["message"] for e in bodies)
    text = gateway.proc.log_path.read_text()
    assert KEY not in text and "unauthorised-body" not in text


def test_probes_are_logged_at_debug_level_only(gateway):
    requests.get(gateway.url + "/health", timeout=30, headers={"X-Request-Id": "probe-1"})
    marker = requests.get(gateway.url + "/v1/models", timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}).headers["X-Request-Id"]
    entries = log_entries(gateway, marker)
    assert not any(e.get("request_id") == "probe-1" for e in entries)  # the gateway logs at info
    assert any(e.get("request_id") == marker and e["status"] == 200 for e in entries)
