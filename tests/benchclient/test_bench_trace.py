"""`pdserve bench --trace`: each request of a trace reaches the server no earlier than its arrival time, with a
prompt of exactly its token count (shared Mooncake blocks as shared prefixes) and its output length asked for.

The server is a small aiohttp app on loopback streaming completion chunks, one per token asked for."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from aiohttp import web

from pdserve import cli

MOONCAKE = [{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [5, 6, 7]},
            {"timestamp": 400, "input_length": 1030, "output_length": 2, "hash_ids": [5, 6, 9]},
            {"timestamp": 900, "input_length": 12, "output_length": 4, "hash_ids": []}]


@pytest.fixture
def server():
    seen: list[tuple[float, dict]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((time.perf_counter(), body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            event = {"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == body["max_tokens"] - 1
                                  else None}], "usage": {"completion_tokens": i + 1}}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1", seen
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_trace_is_replayed_at_its_times_with_exact_lengths(server, tmp_path, capsys):
    base_url, seen = server
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(item) for item in MOONCAKE))
    out = tmp_path / "r.json"
    started = time.perf_counter()
    code = cli.main(["bench", "--base-url", base_url, "--trace", str(trace), "--json", str(out)])
    assert code == 0, capsys.readouterr()
    assert [len(body["prompt"]) for _, body in seen] == [1100, 1030, 12]
    assert [body["max_tokens"] for _, body in seen] == [3, 2, 4]
    first, second, third = (body["prompt"] for _, body in seen)
    assert first[:1024] == second[:1024] and first[1024:1030] != second[1024:1030] and first[:12] != third
    assert all(body["ignore_eos"] and body["stream"] for _, body in seen)
    times = [t for t, _ in seen]
    assert times[1] - times[0] >= 0.4 - 0.02 and times[2] - times[0] >= 0.9 - 0.02  # never early
    assert times[2] - started < 30
    result = json.loads(out.read_text())["results"][0]
    assert result["completed"] == 3 and result["output_tokens"] == 9
    assert "trace" in capsys.readouterr().out


def test_a_malformed_trace_is_one_clear_line(server, tmp_path, capsys):
    base_url, _ = server
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,many,3\n")
    assert cli.main(["bench", "--base-url", base_url, "--trace", str(trace)]) == 1
    assert "line 2: ContextTokens must be a whole number" in capsys.readouterr().err
