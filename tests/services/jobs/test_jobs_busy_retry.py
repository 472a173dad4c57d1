"""Batch items against a busy gateway, and the jobs service's secrets, with real processes.

The gateway stand-in refuses each item's first tries as an overloaded gateway does (429 with or without
Retry-After, 503 with Retry-After), then answers. Items wait those out and succeed even with --retries 0,
which still fails a plain 503 at once. Redis requires a password here: its URL reaches `pdserve jobs` and its
batch worker only through PDSERVE_REDIS_URL, never a command line or a log line.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from jobs_harness import API_KEY, chat_line, client, create_batch, read_lines, wait_batch
from procs import Proc, free_port

PASSWORD = "redis-pass-4c1e9f0b"
# prompt -> the replies before it is answered: (status, Retry-After or None)
REFUSALS = {
    "wait twice": [(429, "1"), (429, "1")],
    "no longer ready": [(503, "1")],
    "no header": [(429, None)],
    "broken": [(503, None)],  # a failure, not a busy gateway: --retries 0 records it at once
}


class BusyGateway(BaseHTTPRequestHandler):
    attempts: dict[str, list[float]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        seen = self.attempts.setdefault(prompt, [])
        seen.append(time.monotonic())
        refusals = REFUSALS.get(prompt, [])
        if len(seen) <= len(refusals) or prompt == "broken":
            status, retry_after = refusals[min(len(seen), len(refusals)) - 1]
            self.reply(status, {"object": "error", "message": "busy", "code": status}, retry_after)
        else:
            self.reply(200, {"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": prompt[::-1]}, "finish_reason": "stop"}]})

    def reply(self, status: int, obj: dict, retry_after: str | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BusyGateway)
    BusyGateway.attempts = {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def redis_url(tmp_path):
    port = free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(f"requirepass {PASSWORD}\nbind 127.0.0.1\nport {port}\ndir {tmp_path}\nsave \"\"\n")
    redis = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL, start_new_session=True)
    yield f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    redis.terminate()
    redis.wait(10)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def test_busy_replies_are_waited_out_and_the_redis_password_stays_out_of_sight(gateway, redis_url):
    port = free_port()
    jobs = Proc(f"jobs:{port}", ["jobs", "--port", str(port), "--gateway-url", gateway, "--batch-workers", "1",
                                 "--retries", "0", "--lease-seconds", "3"],
                health_url=f"http://127.0.0.1:{port}/health")
    jobs.start({"OMP_NUM_THREADS": "1", "PDSERVE_REDIS_URL": redis_url, "PDSERVE_API_KEY": API_KEY})
    try:
        jobs.wait_healthy(60)
        c = client(f"http://127.0.0.1:{port}")
        lines = [chat_line(name, prompt) for name, prompt in (("a", "wait twice"), ("b", "no longer ready"),
                                                              ("c", "no header"), ("d", "broken"), ("e", "fine"))]
        done, _ = wait_batch(c, create_batch(c, lines).id, timeout=60)
        assert done.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
        answers = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"]
                   for o in read_lines(c, done.output_file_id)}
        assert answers == {"a": "wait twice"[::-1], "b": "no longer ready"[::-1], "c": "no header"[::-1],
                           "e": "fine"[::-1]}
        [failed] = read_lines(c, done.error_file_id)
        assert failed["custom_id"] == "d" and failed["response"]["status_code"] == 503
        tries = BusyGateway.attempts
        assert {p: len(t) for p, t in tries.items()} == {"wait twice": 3, "no longer ready": 2, "no header": 2,
                                                         "broken": 1, "fine": 1}
        gaps = [b - a for a, b in zip(tries["wait twice"], tries["wait twice"][1:])]
        assert min(gaps) >= 0.95, gaps  # Retry-After: 1 was honoured

        processes = [jobs.popen.pid, *children_of(jobs.popen.pid)]
        assert len(processes) == 2  # the service and its batch worker
        for pid in processes:
            assert "batch-worker" in cmdline(pid) or "jobs" in cmdline(pid)
            assert PASSWORD not in cmdline(pid) and API_KEY not in cmdline(pid)
    finally:
        jobs.stop()
    log = jobs.log_path.read_text()
    assert "redis://:***@127.0.0.1" in log and PASSWORD not in log
