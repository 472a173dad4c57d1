"""Real gateway and worker processes on loopback for the gateway's integration tests."""
from __future__ import annotations

import asyncio
import time
import urllib.request
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import openai

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.worker.front.generate_many import serve_many
from procs import Proc, free_port, start_worker

API_KEY = "sk-test-gateway-key"
ADMIN_KEY = "sk-test-admin-key"  # every test gateway has it (in its environment), for the admin routes
QUIET = {"OMP_NUM_THREADS": "1"}


@dataclass
class Gateway:
    proc: Proc
    url: str
    api_key: str | None = None

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def admin_headers(self) -> dict:
        """For the admin routes (the admin key also serves every other route)."""
        return {"Authorization": f"Bearer {ADMIN_KEY}"}


def start_gateway(model_dir, *targets: str, admin_key: str | None = ADMIN_KEY) -> Gateway:
    """Start `pdserve gateway` with `targets` (--worker/--prefill/--decode/--api-key ... flags) and `admin_key` in
    its environment (None: no admin key)."""
    port = free_port()
    args = ["gateway", "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--health-check-interval", "0.5", *targets]
    proc = Proc(f"gateway:{port}", args, health_url=f"http://127.0.0.1:{port}/health").start(
        {**QUIET, "PDSERVE_ADMIN_API_KEY": admin_key or ""})
    key = targets[targets.index("--api-key") + 1] if "--api-key" in targets else None
    return Gateway(proc, f"http://127.0.0.1:{port}", key)


def wait_listening(gw: Gateway, timeout: float = 120) -> Gateway:
    """Wait until the gateway answers HTTP at all (its /health may stay 503 when no worker is up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not gw.proc.alive():
            raise RuntimeError(f"gateway exited:\n{gw.proc.tail()}")
        try:
            urllib.request.urlopen(gw.url + "/health", timeout=1)
            return gw
        except urllib.error.HTTPError:
            return gw
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"gateway not listening after {timeout} s:\n{gw.proc.tail()}")


@dataclass
class System:
    """Workers (by gRPC address) and the gateways in front of them."""

    workers: dict[str, Proc] = field(default_factory=dict)
    gateways: list[Gateway] = field(default_factory=list)

    def stop(self) -> None:
        for g in self.gateways:
            g.proc.stop()
        for w in self.workers.values():
            w.stop()


@contextmanager
def pd_pair(model_dir, prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()):
    """A prefill and a decode worker of the default model (each with its extra flags) behind a gateway, all
    healthy: yields (gateway, prefill proc, decode proc, prefill address, decode address); everything stops at
    the end."""
    system = System()
    try:
        prefill, prefill_addr = start_worker("prefill", None, *prefill_args)
        decode, decode_addr = start_worker("decode", None, *decode_args, "--prefill", prefill_addr)
        system.workers.update({prefill_addr: prefill, decode_addr: decode})
        gw = start_gateway(model_dir, "--prefill", prefill_addr, "--decode", decode_addr)
        system.gateways.append(gw)
        for proc in (prefill, decode, gw.proc):
            proc.wait_healthy(120)
        yield gw, prefill, decode, prefill_addr, decode_addr
    finally:
        system.stop()


def answers_and_streams(gw) -> None:
    """The default model behind `gw` answers the France question with Paris, and streams the same greedy text."""
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content  # same greedy tokens, streamed or not


def worker_call(addr: str, method: str, timeout: float = 10.0):
    with grpc.insecure_channel(addr) as ch:
        return getattr(pb_grpc.WorkerStub(ch), method)(pb.Empty(), timeout=timeout)


def wait_idle(addr: str, timeout: float = 15.0) -> tuple[pb.LoadReply, pb.PoolStats]:
    """Wait until the worker runs nothing and holds no pages for requests; returns its last Load and Stats."""
    deadline = time.monotonic() + timeout
    while True:
        load, stats = worker_call(addr, "Load"), worker_call(addr, "Stats")
        if (load.running == 0 and load.waiting == 0 and stats.used_pages == 0) or time.monotonic() > deadline:
            return load, stats
        time.sleep(0.1)


__all__ = ["ADMIN_KEY", "API_KEY", "Gateway", "Multiplexed", "ScriptedWorker", "System", "pd_pair", "start_gateway",
           "start_worker", "wait_idle", "wait_listening", "worker_call"]


# ---------------------------------------------------------------- scripted worker (gateway logic tests)
class Multiplexed:
    """GenerateMany over the stand-in's Generate, as the real worker serves it (the gateway calls GenerateMany)."""

    async def GenerateMany(self, calls, context):
        async def posting(request, call_context, post):  # each message of Generate posted as it comes
            async with contextlib.aclosing(self.Generate(request, call_context)) as messages:
                async for message in messages:
                    post(message)

        async for events in serve_many(posting, calls, context):
            yield events


class ScriptedWorker(Multiplexed, pb_grpc.WorkerServicer):
    """Streams `script` (one list of token ids per message) for choice 0, then finishes as told."""

    def __init__(self, script: list[list[int]], finish: str = "length", stop_token: int = -1,
                 delay: float = 0.01) -> None:
        self.script, self.finish, self.stop_token, self.delay = script, finish, stop_token, delay
        self.sent = 0
        self.ended = asyncio.Event()
        self.completed = False

    async def Generate(self, request, context):
        try:
            for i, ids in enumerate(self.script):
                last = i == len(self.script) - 1
                yield pb.GenerateResponse(prompt_tokens=len(request.input_ids), cached_tokens=3, choices=[
                    pb.ChoiceDelta(index=0, token_ids=ids, finish_reason=self.finish if last else "",
                                   matched_stop_token=self.stop_token if last else -1)])
                self.sent += 1
                await asyncio.sleep(self.delay)
            self.completed = True
        finally:
            self.ended.set()

    async def Health(self, request, context):
        return pb.HealthReply(ok=True, role="colocated")

    async def Load(self, request, context):
        return pb.LoadReply(free_pages=100, total_pages=100)

    async def Info(self, request, context):
        return pb.InfoReply(max_running_requests=8, context_length=8192, compat=pb.Compat(page_size=16))
