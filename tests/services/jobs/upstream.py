"""A TEST upstream standing in for the gateway in the jobs service's tests (not a model server).

Serves POST /v1/chat/completions and /v1/completions with OpenAI-shaped, deterministic replies: the
assistant message (or completion text) is the last user message (or prompt) reversed, and `model` and
`max_tokens` are echoed, so tests can check that each output line belongs to its request. Every reply
waits `--delay` seconds first (a body may override it with `x_delay`), so crash and cancel scenarios have
time to happen. A body with `x_status: N` gets an error reply with that status; `max_tokens < 0` gets a
400 like a real server. GET /stats reports requests seen, per prompt, and the most in flight at once.

Run: python upstream.py --port P [--delay S] [--api-key KEY]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import time

from aiohttp import web


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.by_prompt: collections.Counter[str] = collections.Counter()
        self.in_flight = 0
        self.max_in_flight = 0


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": status}}, status=status)


def make_app(delay: float, api_key: str | None) -> web.Application:
    stats = Stats()

    async def complete(request: web.Request) -> web.Response:
        if api_key and request.headers.get("Authorization") != f"Bearer {api_key}":
            return error(401, "bad api key")
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = (body.get("messages") or [{}])[-1].get("content", "") if chat else str(body.get("prompt", ""))
        stats.requests += 1
        stats.by_prompt[prompt] += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            await asyncio.sleep(float(body.get("x_delay", delay)))
        finally:
            stats.in_flight -= 1
        if "x_status" in body:
            return error(int(body["x_status"]), f"forced status {body['x_status']}")
        if int(body.get("max_tokens", 16)) < 0:
            return error(400, "max_tokens must be at least 0")
        text = prompt[::-1]
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(text.split()),
                 "total_tokens": len(prompt.split()) + len(text.split())}
        common = {"id": f"cmpl-{stats.requests}", "created": int(time.time()), "model": body.get("model", "test"),
                  "usage": usage, "x_max_tokens": body.get("max_tokens")}
        if chat:
            return web.json_response({**common, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})
        return web.json_response({**common, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]})

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response({"requests": stats.requests, "by_prompt": stats.by_prompt,
                                  "in_flight": stats.in_flight, "max_in_flight": stats.max_in_flight})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/stats", get_stats)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    web.run_app(make_app(args.delay, args.api_key), host="127.0.0.1", port=args.port, print=None, access_log=None)
