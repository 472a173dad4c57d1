"""`pdserve bench --api messages`: Anthropic's stream events read as the chat chunks the tally times, and the
request each stream starts with."""
from __future__ import annotations

import argparse

from pdserve.benchclient import cli as bench
from pdserve.benchclient.load import APIS, Load, StreamTally, Target
from pdserve.benchclient.messages import messages_chunk

EVENTS = [
    {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 0}}},
    {"type": "ping"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " there"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "f"}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
    {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 4}},
    {"type": "message_stop"},
]


def test_messages_stream_is_timed_like_a_chat_stream():
    tally = StreamTally(started=0.0)
    for t, event in enumerate(EVENTS, start=1):
        chunk = messages_chunk(event)
        if chunk is not None:
            tally.add(chunk, float(t))
    result = tally.result(ended=11.0)
    assert tally.finished and tally.content_chunks == 3
    assert result.ok and result.output_tokens == 4 and result.ttft_s == 4.0 and result.itls_s == [1.0, 3.0]
    assert messages_chunk({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}) == \
        {"error": {"type": "overloaded_error", "message": "busy"}}


def test_api_flag_picks_the_route_and_body():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser, "bench")
    assert parser.parse_args([]).api == "chat"
    load = bench.load_from_args(parser.parse_args(["--api", "messages", "--output-len", "7"]))
    api = APIS[load.api]
    body = api.body(Target("http://x/v1", "m"), load, "hi", None)
    assert api.path == "/messages" and body["max_tokens"] == 7 and body["ignore_eos"] and body["stream"]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["model"] == "m"
    assert APIS[Load().api].path == "/chat/completions"
