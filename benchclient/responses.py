"""`pdserve bench --api responses`: OpenAI's Responses API as the load, read back as chat chunks.

A request is a streamed /v1/responses call asking for exactly `output_len` tokens (`max_output_tokens` with the
`ignore_eos` extension, as chat's load does). Its typed events become the chat chunks `load.StreamTally`
times: an output_text, reasoning or function-argument delta is content; `response.completed` (or `.incomplete`)
carries the finish and the output tokens; `response.failed` and `error` events are the request's error. The
Responses stream has no per-chunk usage, so inter-token latencies count one token per delta ("chunks").
"""
from __future__ import annotations

CONTENT_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta",
                  "response.function_call_arguments.delta")
FINISH_EVENTS = {"response.completed": "stop", "response.incomplete": "length"}


def responses_body(model: str, prompt: str, output_len: int, temperature: float, extra: dict,
                   previous_response_id: str | None = None) -> dict:
    body = {
        "model": model,
        "input": prompt,
        "max_output_tokens": output_len,
        "ignore_eos": True,  # every request produces exactly output_len tokens
        "temperature": temperature,
        "stream": True,
        **extra,
    }
    if previous_response_id is not None:
        body["previous_response_id"] = previous_response_id
    return body


def responses_chunk(event: dict) -> dict | None:
    """One Responses stream event as the chat chunk it stands for; None for events that carry no output."""
    kind = event.get("type")
    if kind in CONTENT_EVENTS:
        return {"choices": [{"index": 0, "delta": {"content": event.get("delta")}}]} if event.get("delta") else None
    if kind in FINISH_EVENTS:
        usage = (event.get("response") or {}).get("usage") or {}
        return {"choices": [{"index": 0, "delta": {}, "finish_reason": FINISH_EVENTS[kind]}],
                "usage": {"completion_tokens": usage.get("output_tokens")}}
    if kind == "response.failed":
        return {"error": (event.get("response") or {}).get("error") or {"message": "response.failed"}}
    if kind == "error":
        return {"error": {"message": event.get("message") or "error event", "code": event.get("code")}}
    return None
