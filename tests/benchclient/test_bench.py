"""`pdserve bench`: its counts and latency statistics against a streaming server whose timing is known.

The server is a small aiohttp app on loopback that streams OpenAI-style chat chunks: the first content chunk
after TTFT_S, then one chunk every TOKEN_S per token it carries (every other chunk carries two tokens), with
per-chunk usage when the client asks for it and the server is told to give it. It can be told to fail some
requests (HTTP 500 echoing the Authorization header, an error event, a stall), by arrival order.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from pdserve import cli
from pdserve.benchclient import Load, StreamTally, Target, make_prompts, percentile, run_sweep

TTFT_S = 0.05
TOKEN_S = 0.01
MODEL = "fake-model"
KEY = "sk-test-secret-4821"


@dataclass
class Behaviour:
    per_chunk_usage: bool = True
    http_500: set[int] = field(default_factory=set)  # arrival numbers (from 0) answered with HTTP 500
    error_event: set[int] = field(default_factory=set)  # ... that stream an error event after one token
    stall: set[int] = field(default_factory=set)  # ... that go silent for a second after one token
    arrivals: int = 0
    bodies: list[dict] = field(default_factory=list)


def chunk(content: str | None, usage: int | None = None, finish: str | None = None, choices: bool = True) -> bytes:
    event: dict = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, "choices": [], "usage": None}
    if choices:
        event["choices"] = [{"index": 0, "delta": {} if content is None else {"content": content},
                             "finish_reason": finish}]
    if usage is not None:
        event["usage"] = {"prompt_tokens": 40, "completion_tokens": usage, "total_tokens": 40 + usage}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def make_app(behaviour: Behaviour) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        behaviour.bodies.append(body)
        arrival = behaviour.arrivals
        behaviour.arrivals += 1
        if arrival in behaviour.http_500:
            auth = request.headers.get("Authorization", "")
            return web.json_response({"error": {"message": f"boom (you sent {auth})"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await stream(resp, body, arrival)
        except ConnectionResetError:  # the client gave up on a stalled stream
            pass
        return resp

    async def stream(resp: web.StreamResponse, body: dict, arrival: int) -> None:
        continuous = behaviour.per_chunk_usage and body["stream_options"].get("continuous_usage_stats")
        await resp.write(chunk("", 0 if continuous else None))  # the role chunk: no content
        await asyncio.sleep(TTFT_S)
        sent, n = 0, 0
        while sent < body["max_tokens"]:
            carried = 1 if n % 2 == 0 or sent + 2 > body["max_tokens"] else 2
            if n:
                await asyncio.sleep(TOKEN_S * carried)
            sent += carried
            n += 1
            await resp.write(chunk("tok " * carried, sent if continuous else None))
            if arrival in behaviour.error_event:
                await resp.write(b'data: {"error": {"message": "worker lost", "code": 503}}\n\n')
                return
            if arrival in behaviour.stall:
                await asyncio.sleep(1.0)
        await resp.write(chunk(None, sent if continuous else None, finish="length"))
        await resp.write(chunk(None, sent, choices=False))  # include_usage: the final usage chunk
        await resp.write(b"data: [DONE]\n\n")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.fixture
def server() -> Iterator[tuple[str, Behaviour]]:
    """(base URL, behaviour) of the fake server, run on its own loop in a thread so the client may use
    asyncio.run as the CLI does."""
    behaviour = Behaviour()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(behaviour))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1", behaviour
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_counts_and_latencies_follow_the_server(server):
    base_url, behaviour = server
    load = Load(output_len=9, prompt_len=40)
    (s,) = asyncio.run(run_sweep(Target(base_url, MODEL), load, [2], num_requests=6, warmup=1))

    assert (s.requests, s.completed, s.failed) == (6, 6, 0)
    assert behaviour.arrivals == 7  # the warm-up request, then the measured ones
    assert s.output_tokens == 6 * 9
    # Two streams at a time, each ~TTFT_S + 8 * TOKEN_S: three rounds.
    assert 3 * (TTFT_S + 8 * TOKEN_S) <= s.duration_s < 3.0
    assert s.output_tok_s == pytest.approx(s.output_tokens / s.duration_s)
    assert s.request_s == pytest.approx(6 / s.duration_s)
    assert TTFT_S * 1e3 <= s.ttft_ms_p50 <= s.ttft_ms_p90 <= s.ttft_ms_p99 < 500
    # Two-token chunks come after twice the gap: per-chunk usage makes every sample one token's time.
    assert s.itl_tokens_from == "usage"
    assert TOKEN_S * 1e3 * 0.9 <= s.itl_ms_p50 <= s.itl_ms_p90 <= s.itl_ms_p99 < 200
    assert TOKEN_S * 1e3 * 0.9 <= s.tpot_ms_p50 < 100
    assert s.e2e_ms_p50 >= (TTFT_S + 8 * TOKEN_S) * 1e3
    assert s.errors == {}

    body = behaviour.bodies[-1]
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    prompts = [b["messages"][0]["content"] for b in behaviour.bodies]
    assert len(set(prompts)) == len(prompts), "every request, warm-up included, has its own prompt"


def test_cli_counts_failures_shows_each_error_once_and_never_prints_the_key(server, capsys, tmp_path):
    base_url, behaviour = server
    behaviour.per_chunk_usage = False
    behaviour.http_500 = {0, 5}  # one in each level
    behaviour.error_event = {2}
    behaviour.stall = {3}
    out_file = tmp_path / "bench.json"

    code = cli.main(["bench", "--base-url", base_url, "--api-key", KEY, "--concurrency", "1,2",
                     "--num-requests", "4", "--output-len", "6", "--warmup", "0", "--stall-timeout", "0.3",
                     "--json", str(out_file)])

    out, err = capsys.readouterr()
    assert KEY not in out + err + out_file.read_text()
    assert code == 0  # every level completed some requests
    report = json.loads(out_file.read_text())
    assert report["model"] == MODEL  # from GET /models
    first, second = report["results"]
    assert (first["concurrency"], first["completed"], first["failed"]) == (1, 1, 3)
    assert (second["concurrency"], second["completed"], second["failed"]) == (2, 3, 1)
    assert first["output_tokens"] == 6 and second["output_tokens"] == 3 * 6
    # Without per-chunk usage each content chunk counts one token; two-token chunks then double the gap.
    assert second["itl_tokens_from"] == "chunks"
    assert TOKEN_S * 1e3 * 0.9 <= second["itl_ms_p50"] <= second["itl_ms_p99"] < 200
    assert TOKEN_S * 2e3 * 0.9 <= second["itl_ms_p99"]
    assert sum(first["errors"].values()) == 3 and sum(second["errors"].values()) == 1
    # Each distinct error is printed once as it happens, though two requests failed with HTTP 500.
    live = [line for line in err.splitlines() if "request failed" in line]
    assert len(live) == 3, err
    assert any("HTTP 500" in line and "***" in line for line in live)
    assert any("worker lost" in line for line in live)
    assert any("timed out" in line and "stall" in line for line in live)
    assert "TTFT p50" in out and "out tok/s" in out


def test_cli_reports_an_unreachable_server_in_one_line(capsys):
    code = cli.main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--api-key", KEY])
    _, err = capsys.readouterr()
    assert code == 1
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and KEY not in err


def test_usage_on_the_last_content_chunk_alone_does_not_credit_it_every_token():
    tally = StreamTally(started=0.0)
    role, content, last = ({"choices": [{"delta": d, "finish_reason": None}]} for d in
                           ({"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}))
    tally.add(role, 0.01)
    tally.add(content, 0.10)
    tally.add({**last, "usage": {"completion_tokens": 20}}, 0.12)
    result = tally.result(0.13)
    assert result.itls_s == pytest.approx([0.02]) and not result.itl_tokens_from_usage
    assert result.ttft_s == pytest.approx(0.10) and result.output_tokens == 20


def test_prompts_are_distinct_repeatable_and_about_the_asked_length():
    prompts = make_prompts(50, 40, seed=3)
    assert len(set(prompts)) == 50
    assert prompts == make_prompts(50, 40, seed=3)
    assert all(len(p.split()) == 40 for p in prompts)
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None


def test_models_spread_the_requests_over_several_models_in_turn(server):
    base_url, behaviour = server
    load = Load(output_len=3, prompt_len=10, models=("a", "b", "c"))
    asyncio.run(run_sweep(Target(base_url, MODEL), load, [2], num_requests=6, warmup=0))
    assert sorted(b["model"] for b in behaviour.bodies) == ["a", "a", "b", "b", "c", "c"]


def test_cli_progress_bars_and_a_throughput_latency_plot(server, capsys, tmp_path):
    base_url, _ = server
    png = tmp_path / "bench.png"
    code = cli.main(["bench", "--base-url", base_url, "--concurrency", "1,4", "--num-requests", "4",
                     "--output-len", "6", "--warmup", "0", "--progress", "--plot", str(png)])
    out, err = capsys.readouterr()
    assert code == 0
    assert "concurrency 1" in err and "concurrency 4" in err and "4/4" in err  # a bar per level, to the end
    assert f"plot: {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a drawn figure, not an empty canvas


def test_several_client_processes_send_every_prompt_once_and_count_every_request(server):
    base_url, behaviour = server
    load = Load(output_len=5, prompt_len=40)
    (s,) = asyncio.run(run_sweep(Target(base_url, MODEL), load, [4], num_requests=10, warmup=1, processes=2))
    assert (s.requests, s.completed, s.failed, s.output_tokens) == (10, 10, 0, 50)
    # Four streams in all, two per process: three rounds.
    assert 3 * (TTFT_S + 4 * TOKEN_S) <= s.duration_s < 5.0
    sent = [b["messages"][0]["content"] for b in behaviour.bodies]
    assert len(sent) == 11 and sorted(sent) == sorted(make_prompts(11, 40, 0))  # warm-up included, none twice
