"""Real processes for the jobs service tests: redis-server, the test upstream, `pdserve jobs`/`batch-worker`,
plus helpers to write batch input files and wait on batches through the official openai client."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import redis

from procs import Proc, free_port

HERE = Path(__file__).parent
API_KEY = "sk-jobs-test"
PREFIX = "pdserve:jobs:"
TERMINAL = {"completed", "failed", "expired", "cancelled"}
# Settings of the shared test system (conftest.py).
MAX_FILE_SIZE = 2_000_000
CONCURRENCY = 8
RETRIES = 2


@dataclass
class RedisServer:
    """A real redis-server with append-only persistence in `dir`; restartable on the same port and data."""

    dir: Path
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 20.0) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.popen = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--daemonize", "no", "--dir",
             str(self.dir), "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=open(self.dir / "redis.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not start")

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, decode_responses=True, socket_timeout=5)

    def stop(self) -> None:
        """SIGTERM: Redis writes its append-only file and exits."""
        if self.popen and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            self.popen.wait(20)

    def kill(self) -> None:
        """SIGKILL: only what the append-only file already holds (fsynced on every write) survives."""
        if self.popen and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(20)


@dataclass
class Upstream:
    """tests/services/jobs/upstream.py, the test stand-in for the gateway."""

    delay: float = 0.02
    api_key: str | None = API_KEY
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Upstream:
        argv = [sys.executable, str(HERE / "upstream.py"), "--port", str(self.port), "--delay", str(self.delay)]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        self.popen = subprocess.Popen(argv, start_new_session=True)
        wait_http(f"{self.url}/health", self.popen)
        return self

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)


def wait_http(url: str, popen: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {popen.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


QUIET = {"OMP_NUM_THREADS": "1"}


def start_jobs(redis_url: str, gateway_url: str, *extra: str, api_key: str | None = API_KEY) -> tuple[Proc, str]:
    """`pdserve jobs` on a free port, healthy; returns (process, base URL)."""
    port = free_port()
    args = ["jobs", "--port", str(port), "--redis-url", redis_url, "--gateway-url", gateway_url, *extra]
    if api_key:
        args += ["--api-key", api_key]
    proc = Proc(f"jobs:{port}", args, health_url=f"http://127.0.0.1:{port}/health").start(QUIET)
    proc.wait_healthy(60)
    return proc, f"http://127.0.0.1:{port}"


def start_worker(redis_url: str, gateway_url: str, *extra: str, api_key: str | None = API_KEY) -> Proc:
    args = ["batch-worker", "--redis-url", redis_url, "--gateway-url", gateway_url, *extra]
    if api_key:
        args += ["--api-key", api_key]
    return Proc("batch-worker", args).start(QUIET)


def client(base_url: str, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=30)


# ---------------------------------------------------------------- batch files and waiting


def chat_line(custom_id: str, text: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "test-model", "messages": [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": text}],
                     "max_tokens": 8, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def upload(c: openai.OpenAI, content: bytes, name: str = "input.jsonl", purpose: str = "batch"):
    return c.files.create(file=(name, content), purpose=purpose)


def create_batch(c: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions", **kw):
    f = upload(c, jsonl(lines))
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)


def wait_batch(c: openai.OpenAI, batch_id: str, statuses=TERMINAL, timeout: float = 30.0,
               until=None) -> tuple[object, list[str]]:
    """Poll until the batch reaches one of `statuses` (or `until(batch)` holds); returns it and the statuses seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        batch = c.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if batch.status in statuses or (until is not None and until(batch)):
            return batch, seen
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s (saw {seen}): {batch}")
        time.sleep(0.1)


def read_lines(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines() if line.strip()]


def batch_keys(r: redis.Redis, batch_id: str) -> dict:
    """What Redis holds for a batch besides its record: queued items, result hashes, input-file use."""
    items = [f for _, f in r.xrange(PREFIX + "items") if f.get("b") == batch_id]
    record = r.hgetall(f"{PREFIX}batch:{batch_id}")
    return {"items": len(items), "out": r.exists(f"{PREFIX}batch:{batch_id}:out"),
            "err": r.exists(f"{PREFIX}batch:{batch_id}:err"),
            "file_users": r.scard(f"{PREFIX}file:{record.get('input_file_id')}:users"),
            "deadline": r.zscore(PREFIX + "deadlines", batch_id)}


def kill_pid(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
