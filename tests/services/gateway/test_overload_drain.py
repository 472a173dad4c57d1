"""A real gateway process under overload and SIGTERM, in front of an in-process stand-in worker.

The stand-in streams one token per 50 ms, as many as the request's max_tokens, so the test decides how long
each stream lasts. Admission: 429 with Retry-After, at once, beyond what the worker runs plus the queue
limit, counting n as n sequences. Stop: streams in progress finish, new requests get 503, what outlives the
drain timeout ends with an error event, and the process exits soon after.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time

import aiohttp
import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from harness import Multiplexed, start_gateway

MAX_RUNNING = 8  # what the stand-in reports in Info
TOKEN = 1000  # an ordinary token id
DELAY = 0.05


class PacedWorker(Multiplexed, pb_grpc.WorkerServicer):
    """Streams max_new_tokens tokens of choice 0, one per DELAY seconds."""

    async def Generate(self, request, context):
        count = request.sampling.max_new_tokens
        for i in range(count):
            yield pb.GenerateResponse(prompt_tokens=len(request.input_ids), choices=[
                pb.ChoiceDelta(index=0, token_ids=[TOKEN], finish_reason="length" if i == count - 1 else "")])
            await asyncio.sleep(DELAY)

    async def Health(self, request, context):
        return pb.HealthReply(ok=True, role="colocated")

    async def Load(self, request, context):
        return pb.LoadReply(free_pages=100, total_pages=100)

    async def Info(self, request, context):
        return pb.InfoReply(max_running_requests=MAX_RUNNING, context_length=8192, compat=pb.Compat(page_size=16))


@pytest.fixture
async def worker():
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(PacedWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def started_gateway(model_dir, *flags: str):
    gw = start_gateway(model_dir, *flags)
    await asyncio.to_thread(gw.proc.wait_healthy, 60)  # the worker answers on this loop meanwhile
    return gw


def body(max_tokens: int, n: int = 1, stream: bool = True) -> dict:
    return {"model": "default", "prompt": "hello", "max_tokens": max_tokens, "n": n, "stream": stream}


async def open_stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> aiohttp.ClientResponse:
    """A streamed completion, once its first event arrived."""
    response = await session.post(url + "/v1/completions", json=body(max_tokens))
    assert response.status == 200, await response.text()
    assert (await response.content.readline()).startswith(b"data: ")
    return response


async def events(response: aiohttp.ClientResponse) -> list:
    """The rest of a stream's events, parsed; [DONE] as the string "[DONE]"."""
    out = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def test_beyond_the_limit_is_429_with_retry_after_at_once_counting_n(default_model_dir, worker):
    gw = await started_gateway(default_model_dir, "--worker", worker, "--max-queued-requests", "2")
    streams = []
    try:
        async with aiohttp.ClientSession() as session:
            # 9 of the 10 places (8 running on the worker + 2 queued) taken by long streams
            streams = await asyncio.gather(*(open_stream(session, gw.url, 2000) for _ in range(MAX_RUNNING + 1)))
            async with session.post(gw.url + "/v1/completions", json=body(4, n=2, stream=False)) as r:
                assert r.status == 429  # n=2 is two sequences: one more than the place left
                error = await r.json()
                assert int(r.headers["Retry-After"]) >= 1
            assert error["object"] == "error" and error["code"] == 429 and error["type"] == "rate_limit_error"
            assert "--max-queued-requests" in error["message"]
            streams.append(await open_stream(session, gw.url, 2000))  # n=1 takes the last place

            took = []
            for _ in range(10):
                start = time.perf_counter()
                async with session.post(gw.url + "/v1/chat/completions", json={
                        "model": "default", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
                    await r.read()
                    took.append(time.perf_counter() - start)
                    assert r.status == 429 and "Retry-After" in r.headers
            assert max(took) < 0.5 and statistics.median(took) < 0.05, took  # refused, not queued

            for s in streams:
                s.close()
            streams = []
            deadline = time.monotonic() + 10
            while True:  # the places come back as the streams end
                async with session.post(gw.url + "/v1/completions", json=body(3, stream=False)) as r:
                    if r.status == 200:
                        assert (await r.json())["choices"][0]["finish_reason"] == "length"
                        break
                    assert r.status == 429 and time.monotonic() < deadline
                await asyncio.sleep(0.1)
    finally:
        for s in streams:
            s.close()
        await asyncio.to_thread(gw.proc.stop)


async def test_sigterm_lets_streams_finish_refuses_new_requests_and_exits_in_time(default_model_dir, worker):
    drain_s = 3.0
    gw = await started_gateway(default_model_dir, "--worker", worker, "--drain-timeout", str(drain_s))
    try:
        async with aiohttp.ClientSession() as session:
            short = [await open_stream(session, gw.url, 30) for _ in range(3)]  # about 1.5 s each
            long = await open_stream(session, gw.url, 1000)  # 50 s: outlives the drain timeout
            rest = [asyncio.create_task(events(s)) for s in (*short, long)]
            stopped = time.monotonic()
            os.kill(gw.proc.popen.pid, signal.SIGTERM)

            deadline = time.monotonic() + 2
            while True:  # once the signal is handled, /health says so, and new requests are refused
                async with session.get(gw.url + "/health") as r:
                    if r.status == 503:
                        assert int(r.headers["Retry-After"]) >= 1
                        break
                assert time.monotonic() < deadline, "the gateway kept reporting healthy after SIGTERM"
                await asyncio.sleep(0.05)
            async with session.post(gw.url + "/v1/completions", json=body(4, stream=False)) as r:
                assert r.status == 503 and "shutting down" in (await r.json())["message"]
            async with session.get(gw.url + "/live") as r:  # draining, not dead: liveness holds
                assert r.status == 200

            *finished, cut = await asyncio.gather(*rest)
            for evs in finished:  # complete: every token, the finish reason, [DONE], no error
                assert evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1])
                assert evs[-2]["choices"][0]["finish_reason"] == "length"
            assert cut[-1] == "[DONE]" and "error" in cut[-2]  # ended with an error event, not cut off
            code = await asyncio.to_thread(gw.proc.popen.wait, drain_s + 5)
            assert code == 0
            assert time.monotonic() - stopped < drain_s + 2, gw.proc.tail()
    finally:
        await asyncio.to_thread(gw.proc.stop)
