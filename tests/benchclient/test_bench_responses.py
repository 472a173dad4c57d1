"""`pdserve bench --api responses`: Responses stream events read as chat chunks, and `--chain` against a small
streaming server that checks each turn continues the last one."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from pdserve.benchclient.chain import format_chain, run_chain
from pdserve.benchclient.load import Load, StreamTally, Target
from pdserve.benchclient.responses import responses_body, responses_chunk


def test_events_become_chat_chunks_the_tally_counts():
    tally = StreamTally(0.0)
    events = [{"type": "response.created", "response": {"id": "resp_1"}},
              {"type": "response.output_text.delta", "delta": "Hel"},
              {"type": "response.output_text.delta", "delta": "lo"},
              {"type": "response.completed", "response": {"usage": {"output_tokens": 2}}}]
    for now, event in enumerate(events):
        if (chunk := responses_chunk(event)) is not None:
            tally.add(chunk, float(now))
    result = tally.result(4.0)
    assert tally.finished and result.ok and result.output_tokens == 2 and result.ttft_s == 1.0
    assert responses_chunk({"type": "response.failed", "response": {"error": {"message": "x"}}}) == \
        {"error": {"message": "x"}}
    body = responses_body("m", "hi", 8, 0.0, {}, "resp_1")
    assert body["max_output_tokens"] == 8 and body["ignore_eos"] and body["previous_response_id"] == "resp_1"


def test_chain_turns_continue_the_last_response_and_are_reported_per_turn():
    seen: list[tuple[str | None, str]] = []

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = f"resp_{len(seen)}"
        seen.append((body.get("previous_response_id"), rid))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prompt_tokens = 40 * (1 + len([p for p, _ in seen if p is not None]))
        for event in ({"type": "response.created", "response": {"id": rid}},
                      {"type": "response.output_text.delta", "delta": "ok"},
                      {"type": "response.completed", "response": {"id": rid, "usage": {
                          "input_tokens": prompt_tokens, "output_tokens": 1,
                          "input_tokens_details": {"cached_tokens": prompt_tokens - 40}}}}):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/v1/responses", responses)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await run_chain(Target(f"http://127.0.0.1:{port}/v1", "m", None), Load(output_len=4), 2, 3)
        finally:
            await runner.cleanup()

    turns = asyncio.run(run())
    assert [t.turn for t in turns] == [1, 2, 3] and all(t.completed == 2 and t.failed == 0 for t in turns)
    assert turns[0].ttft_vs_first == 1.0
    ids = {rid for _, rid in seen}
    assert sum(previous is None for previous, _ in seen) == 2  # each conversation starts once
    assert all(previous in ids for previous, _ in seen if previous is not None)  # then continues its last turn
    assert turns[2].cached_tokens_p50 > turns[0].cached_tokens_p50
    assert "vs turn 1" in format_chain(turns)
