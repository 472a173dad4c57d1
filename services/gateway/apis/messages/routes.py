"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request takes chat's path (architecture.md): the body parsed (protocol.py), the content blocks
mapped onto the chat template and its tools onto a `ToolPlan` (`any` and `tool` enforced with the grammar that
enforces chat's `required` and named tool choices), the sampling fields read through the dialect's table
(dialects.ANTHROPIC_MESSAGES) by `intake`, one generation, and its output shaped by `format.py`.

Streaming: `message_start` goes out with the first output, so a request the workers refuse still gets a plain
HTTP status; a request that waits longer than PING_INTERVAL_S for it (queued, a long prefill) starts the
stream then and gets a `ping` every PING_INTERVAL_S while nothing else is sent. A failure after the stream
started is an `error` event. Every error on these routes, raised anywhere (auth, body limits, drain), is in
Anthropic's shape (`anthropic_errors`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp import web

from pdserve.services import tracing
from pdserve.services.gateway import intake
from pdserve.services.gateway.apis.context import GATEWAY, SSE, Gateway, new_id
from pdserve.services.gateway.apis.messages import format as fmt
from pdserve.services.gateway.apis.messages.protocol import (CountTokensRequest, MessagesRequest, continues_last,
                                                             plan_tools, template_messages)
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.dialects import ANTHROPIC_MESSAGES
from pdserve.services.gateway.intake.protocol import parse
from pdserve.services.gateway.intake.tool_calls import ToolPlan
from pdserve.services.gateway.limits import text_chars
from pdserve.services.gateway.tokenization import ReservedTemplateKwarg
from pdserve.services.gateway.workers.job import Job
from pdserve.shared.logs import REQUEST_ID

PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
PING_INTERVAL_S = 10.0


# ---------------------------------------------------------------- the prompt
async def _prompt(gw: Gateway, req: CountTokensRequest | MessagesRequest) -> tuple[list[int], ToolPlan, str | None]:
    """(prompt ids, tool plan, reasoning parser) of a request, as chat renders them."""
    await gw.check_model(req.model)
    tools = plan_tools(req, gw.tool_call_parser)
    thinking = req.thinking.type if req.thinking is not None else None
    kwargs = None if thinking is None else {"enable_thinking": thinking != "disabled"}
    prefill = continues_last(req)
    messages = template_messages(req)
    # The rendered prompt holds every message's text: more than the context can hold is refused unrendered.
    chars = text_chars(messages)
    gw.inputs.check_chars(chars, "messages")

    def render_ids() -> list[int]:
        text = gw.tokenizer.render_chat(messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                                        template_kwargs=kwargs, tools=tools.template_tools)
        return gw.inputs.prompt_ids(text, "messages", add_special_tokens=False)

    try:
        with tracing.section("tokenize", messages=len(messages)):
            ids = await gw.cpu.run(chars + 64 * len(messages), render_ids)
    except ReservedTemplateKwarg as exc:
        raise ApiError(400, f"The chat template cannot take 'thinking': {exc}", "thinking") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages") from None
    return ids, tools, gw.reasoning_parser if thinking != "disabled" else None


async def count_tokens(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = await read_json(request)
    if isinstance(body, dict):
        gw.limits.messages(body)  # before anything is parsed or rendered
    req = parse(CountTokensRequest, body)
    ids, _, _ = await _prompt(gw, req)
    return web.json_response({"input_tokens": len(ids)})


# ---------------------------------------------------------------- messages
async def create_message(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    body = await read_json(request)
    if isinstance(body, dict):
        gw.limits.messages(body)  # before anything is parsed or rendered
    req = parse(MessagesRequest, body)
    ids, tools, parser = await _prompt(gw, req)
    # Anthropic's clients ask for as much as their hosted models allow (32k and more): what the context leaves
    # after the prompt is all there is, so more is served as that much (SGLang's auto-truncation), not refused.
    job = await intake.job(gw.inputs, ANTHROPIC_MESSAGES, req, ids, rid=new_id(), lora=await gw.adapter_of(req.model),
                           max_tokens=req.max_tokens, public_id=fmt.new_message_id(), tools=tools,
                           reasoning_parser=parser)
    await gw.backend.admit()
    with gw.backend.generation(job) as gen:
        if req.stream:
            return await _stream(request, req, job, gen, fmt.MessageWriter(parser, tools))
        results = await gen.collect()
    r = results[0]
    writer = fmt.MessageWriter(parser, tools)
    writer.push(r.text, final=True)
    reason, sequence = fmt.stop_reason(r.finish_reason, r.matched_stop, writer.called)
    return web.json_response(fmt.message(job.public_id, req.model, writer.blocks.final(), reason, sequence,
                                         fmt.usage(gen.prompt_tokens, gen.completion_tokens, cached(request, gen))))


def cached(request: web.Request, gen) -> int:
    """cache_read_input_tokens: 0 unless --enable-cache-report (context.Gateway.reported_cached)."""
    return request.app[GATEWAY].reported_cached(gen.cached_tokens)


class EventStream(SSE):
    """Anthropic's server-sent events: `event: <type>` and its data, no `[DONE]` (message_stop ends it)."""

    async def send(self, obj: dict) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        data = f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
        await self._write(data)

    async def fail(self, exc: ApiError) -> web.StreamResponse:
        if not self.started:
            raise exc
        status = fmt.STATUS.get(exc.status, exc.status)
        await self.send(fmt.error_body(status, exc.message))
        return await self.done()

    async def done(self) -> web.StreamResponse:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self._end()
        return self.response


async def _stream(request: web.Request, req: MessagesRequest, job: Job, gen,
                  writer: fmt.MessageWriter) -> web.StreamResponse:
    sse = EventStream(request)

    async def start() -> None:
        empty = fmt.usage(gen.prompt_tokens, 0, cached(request, gen))
        await sse.send({"type": "message_start",
                        "message": fmt.message(job.public_id, req.model, [], None, None, empty)})
        await sse.send({"type": "ping"})

    reason: tuple[str, str | None] = ("end_turn", None)
    try:
        # Closed inner first: the update a ping interrupted is cancelled before its generator is closed.
        async with contextlib.aclosing(gen.updates()) as updates, \
                contextlib.aclosing(_with_pings(updates, PING_INTERVAL_S)) as events:
            async for u in events:
                if not sse.started:
                    await start()
                if u is None:
                    await sse.send({"type": "ping"})
                    continue
                final = u.finish_reason is not None
                for event in writer.push(u.text, final):
                    await sse.send(event)
                if final:
                    reason = fmt.stop_reason(u.finish_reason, u.matched_stop, writer.called)
    except ApiError as exc:
        return await sse.fail(exc)
    if not sse.started:
        await start()
    await sse.send({"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                    "usage": fmt.usage(gen.prompt_tokens, gen.completion_tokens, cached(request, gen))})
    await sse.send({"type": "message_stop"})
    return await sse.done()


async def _with_pings(updates, interval_s: float):
    """The updates of `updates`, with None whenever `interval_s` passes without one (time for a ping)."""
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(updates))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


# ---------------------------------------------------------------- errors in Anthropic's shape
@web.middleware
async def anthropic_errors(request: web.Request, handler):
    """On the Messages routes, every error answer (made by any middleware or handler in OpenAI's shape) is
    rewritten in Anthropic's: `{"type": "error", "error": {"type", "message"}, "request_id"}`, 503 as 529."""
    response = await handler(request)
    if request.path not in PATHS or response.status < 400 or not isinstance(response, web.Response) \
            or response.content_type != "application/json":
        return response
    try:
        message = json.loads(response.body)["message"]
    except (ValueError, KeyError, TypeError):
        return response
    status = fmt.STATUS.get(response.status, response.status)
    out = web.json_response(fmt.error_body(status, message, REQUEST_ID.get(None)), status=status)
    for name in ("Retry-After", "Connection"):
        if name in response.headers:
            out.headers[name] = response.headers[name]
    if response.keep_alive is False:
        out.force_close()
    return out


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
