"""`pdserve bench --api messages`: Anthropic's Messages API as the load, read back as chat chunks.

A request is a streamed /v1/messages call asking for exactly `output_len` tokens (`max_tokens` with the
`ignore_eos` extension, as chat's load does). Its events are turned into the chat chunks `load.StreamTally`
times: a text, thinking or tool-input delta is content; `message_delta` carries the finish and the output
tokens; an `error` event is the request's error. Anthropic's stream has no per-chunk usage, so inter-token
latencies count one token per content event (`itl_tokens_from` says "chunks").
"""
from __future__ import annotations

DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


def messages_body(model: str, prompt: str, output_len: int, temperature: float, extra: dict) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "ignore_eos": True,  # every request produces exactly output_len tokens
        "temperature": temperature,
        "stream": True,
        **extra,
    }


def messages_chunk(event: dict) -> dict | None:
    """One Messages stream event as the chat chunk it stands for; None for events that carry no output."""
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        key = DELTA_TEXT.get(delta.get("type"))
        text = delta.get(key) if key else None
        return {"choices": [{"index": 0, "delta": {"content": text}}]} if text else None
    if kind == "message_delta":
        usage = event.get("usage") or {}
        return {"choices": [{"index": 0, "delta": {}, "finish_reason": (event.get("delta") or {}).get("stop_reason")}],
                "usage": {"completion_tokens": usage.get("output_tokens")}}
    if kind == "error":
        return {"error": event.get("error") or {"message": "error event"}}
    return None
