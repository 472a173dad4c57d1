"""OpenAI's Responses API: POST /v1/responses, and GET, DELETE, cancel and input_items of a stored response.

A request takes the chat path: its items (with the conversation of `previous_response_id` before them, read
from the response store) become chat messages and the chat template's prompt; its sampling fields go through
the dialect table (dialects.OPENAI_RESPONSES) into `intake.job`; one generation runs on the workers, and the
output is read by the chat path's reasoning splitter and tool-call stream (output.py). A chained
request's prompt starts with the tokens of the earlier turns, so the router's prefix affinity sends it to the
worker whose cache holds them.

Lifecycle of a response: `store` true (the default) writes it when it ends; `background` writes it `queued`
at once and runs it in a task of this gateway (`Background`), which moves it to in_progress, then to its end
unless a cancel got there first (store.py: each transition is atomic).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from opentelemetry.trace import get_current_span as current_span
from redis.exceptions import RedisError

from pdserve.services import tracing
from pdserve.services.gateway import intake
from pdserve.services.gateway.apis.context import GATEWAY, SSE, Gateway, new_id
from pdserve.services.gateway.apis.responses import output as out
from pdserve.services.gateway.apis.responses.items import (ResponsesRequest, chat_messages, input_items,
                                                           tool_choice_out, tool_plan)
from pdserve.services.gateway.apis.responses.store import (IN_FLIGHT, MemoryResponses, ResponseStore, Stored,
                                                           is_response_id, new_item_id)
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.dialects import OPENAI_RESPONSES
from pdserve.services.gateway.intake.protocol import UNSUPPORTED_OPENAI, parse, refuse_unsupported
from pdserve.services.gateway.intake.tool_calls import ToolPlan, template_messages
from pdserve.services.gateway.limits import text_chars
from pdserve.services.gateway.tokenization import ReservedTemplateKwarg
from pdserve.services.gateway.workers.job import Job

log = logging.getLogger("pdserve.gateway")
UNSUPPORTED_RESPONSES = {**UNSUPPORTED_OPENAI, "prompt": "prompt templates", "conversation": "conversations",
                         "top_logprobs": "top_logprobs"}
CANCEL_POLL_S = 0.25  # how often a background response checks whether another replica cancelled it
MAX_LIST = 100


class Responses:
    """The store, and the background responses this gateway runs (by id)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.running: dict[str, asyncio.Task] = {}

    async def read(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response; when there is none, a 404 (a 400 where a request names it: `param`)."""
        record = await self.call(self.store.get(response_id)) if is_response_id(response_id) else None
        if record is None:
            where = f" Responses are kept {self.store.where}." if not self.store.shared else ""
            # a request that names one is a bad request (400, as OpenAI answers); a path that names one, a 404
            status = 400 if param == "previous_response_id" else 404
            raise ApiError(status, f"Response with id {response_id!r} not found (never stored, expired or "
                                   f"deleted).{where}", param)
        return record

    async def call(self, awaitable):
        """A store operation; Redis out of reach is a 503, not a 500."""
        try:
            return await awaitable
        except (RedisError, OSError) as exc:
            log.warning("response store: %s", exc)
            raise ApiError(503, "The response store (Redis) is not reachable; try again.") from None


RESPONSES: web.AppKey[Responses] = web.AppKey("responses", Responses)


# ---------------------------------------------------------------- create
async def create_response(request: web.Request) -> web.StreamResponse:
    gw, responses = request.app[GATEWAY], request.app[RESPONSES]
    body = await read_json(request)
    if isinstance(body, dict):
        gw.limits.responses(body)  # before anything is parsed or rendered
    refuse_unsupported({k: v for k, v in body.items() if not (k == "top_logprobs" and v == 0)}, UNSUPPORTED_RESPONSES)
    req = parse(ResponsesRequest, body)
    if req.background and not req.store:
        raise ApiError(400, "A background response is stored: 'background' needs 'store' to be true.", "background")
    if req.background and req.stream:
        raise ApiError(400, "Streaming a background response is not supported: give 'background' or 'stream'.",
                       "stream")
    lora = await gw.adapter_of(req.model, req.lora_path)
    plan = tool_plan(req, gw.tool_call_parser)
    history: list[dict] = []
    trace = tracing.traceparent_of(current_span())  # stored with the response: a continuation links to it
    if req.previous_response_id is not None:
        previous = await responses.read(req.previous_response_id, "previous_response_id")
        tracing.link_current(previous.trace, {"pdserve.previous_response_id": req.previous_response_id})
        if previous.response["status"] in IN_FLIGHT:
            raise ApiError(400, f"Response {req.previous_response_id!r} is still {previous.response['status']}: "
                                "continue it once it has ended.", "previous_response_id")
        history = previous.input + previous.response["output"]
    conversation, ids = await prompt(gw, req, plan, history + input_items(req.input), len(history))
    rid = new_item_id("resp_")
    job = await intake.job(gw.inputs, OPENAI_RESPONSES, req, ids, rid=new_id(), lora=lora,
                           max_tokens=req.max_output_tokens, public_id=rid, response_format=req.response_format(),
                           tools=plan, reasoning_parser=gw.reasoning_parser, return_logprob=False, top_logprobs_num=0,
                           renamed={"json_schema": "text.format"} if req.response_format() is not None else None)
    response = out.shell(rid, req, req.model or gw.served_model_name, out.tools_out(plan),
                         tool_choice_out(plan, req.tool_choice))
    if req.background:
        await gw.backend.admit()  # refused now (429, 503) rather than failed later
        queued = {**response, "status": "queued"}
        await responses.call(responses.store.put(Stored(queued, conversation, trace)))
        task = asyncio.create_task(run_background(gw, responses, job, plan, queued, conversation))
        responses.running[rid] = task
        task.add_done_callback(lambda _: responses.running.pop(rid, None))
        return web.json_response(queued)
    builder = out.OutputBuilder(gw.reasoning_parser, plan)
    await gw.backend.admit()
    with gw.backend.generation(job) as gen:
        if req.stream:
            return await stream_response(request, gw, responses, req.store, gen, builder, response, conversation,
                                         trace)
        results = await gen.collect()
    final, _ = finish(gw, gen, builder, response, results[0].text, results[0].finish_reason)
    if req.store:
        await responses.call(responses.store.put(Stored(final, conversation, trace)))
    return web.json_response(final)


async def prompt(gw: Gateway, req: ResponsesRequest, plan: ToolPlan, items: list[dict],
                 earlier: int) -> tuple[list[dict], list[int]]:
    """(the conversation, its prompt ids); the first `earlier` items come from `previous_response_id`. Past the
    context: a 400 naming the limit, or with truncation "auto" as few of the oldest turns dropped as make it fit
    (the request's own input is never dropped). Text that cannot fit is refused by its size before it is
    rendered; the rest is rendered and tokenized on the gateway's pool when large, a few times at most (the
    turns to drop are found by bisection)."""
    limit = gw.backend.context_length()
    gw.inputs.check_chars(text_chars(req.instructions) + text_chars(items[earlier:]), "input")  # never dropped
    if req.truncation != "auto":
        chain = " with the conversation of 'previous_response_id'" if earlier else ""
        gw.limits.count(items, "max_messages", "previous_response_id" if earlier else "input")
        gw.inputs.check_chars(text_chars(req.instructions) + text_chars(items), "input",
                       "; pass truncation: 'auto' to drop the oldest items" if earlier else "")
        ids = await ids_of(gw, req, plan, items)
        if len(ids) >= limit:
            raise ApiError(400, f"The input{chain} is {len(ids)} tokens, which is not shorter than the model's "
                                f"context length of {limit} tokens" + ("; pass truncation: 'auto' to drop the oldest "
                                                                        "items." if earlier else "."), "input")
        return items, ids
    # Where the kept conversation may start: the first item, an earlier turn's user message (a tool output is
    # never left without its call), or the request's own input; never more items than a chat may hold.
    starts = [0] + [k for k in range(1, earlier) if items[k]["type"] == "message" and items[k]["role"] == "user"]
    starts = sorted({k for k in starts + [earlier] if len(items) - k <= gw.limits.max_messages})
    max_chars = limit * gw.tokenizer.max_token_chars
    lo, hi, best = 0, len(starts) - 1, None  # the first start that fits: keeping less fits whenever more does
    while lo <= hi:
        mid = (lo + hi) // 2
        kept = items[starts[mid]:]
        ids = None
        if text_chars(req.instructions) + text_chars(kept) <= max_chars:
            ids = await ids_of(gw, req, plan, kept)
        if ids is not None and len(ids) < limit:
            best, hi = (kept, ids), mid - 1
        else:
            lo = mid + 1
    if best is None:
        raise ApiError(400, f"The input is not shorter than the model's context length of {limit} tokens, even "
                            "with every earlier turn dropped.", "input")
    return best


async def ids_of(gw: Gateway, req: ResponsesRequest, plan: ToolPlan, items: list[dict]) -> list[int]:
    """The prompt ids of `items`: rendered and tokenized inline when short, else on the gateway's pool."""
    size = text_chars(req.instructions) + text_chars(items) + 64 * len(items)
    with tracing.section("tokenize", items=len(items)):
        return await gw.cpu.run(size, lambda: gw.tokenizer.encode(render(gw, req, plan, items),
                                                                  add_special_tokens=False))


def render(gw: Gateway, req: ResponsesRequest, plan: ToolPlan, items: list[dict]) -> str:
    messages = template_messages(chat_messages(req.instructions, items))
    try:
        return gw.tokenizer.render_chat(messages, tools=plan.template_tools)
    except ReservedTemplateKwarg as exc:  # not reachable from this API; kept for the template's own errors
        raise ApiError(400, str(exc), "input") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "input") from None


def finish(gw: Gateway, gen, builder: out.OutputBuilder, response: dict, text: str,
           finish_reason: str | None) -> tuple[dict, list[dict]]:
    """(the response object once the generation ended, the events that end its items); `text`: the output not
    pushed to `builder` yet."""
    status, incomplete = out.outcome(finish_reason, gw.responses_incomplete_status)
    events = builder.push(text, final=True, status="incomplete" if incomplete else "completed")
    reasoning = builder.reasoning_text
    reasoning_tokens = len(gw.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    usage = out.usage(gen.prompt_tokens, gen.completion_tokens, gw.reported_cached(gen.cached_tokens),
                      reasoning_tokens)
    return out.finished(response, status, builder.items, usage, incomplete), events


# ---------------------------------------------------------------- streaming
async def stream_response(request: web.Request, gw: Gateway, responses: Responses, store: bool, gen,
                          builder: out.OutputBuilder, response: dict, conversation: list[dict],
                          trace: str) -> web.StreamResponse:
    sse, events = SSE(request), out.Events()
    last = None
    try:
        async with contextlib.aclosing(gen.updates()) as updates:
            async for u in updates:
                if not sse.started:  # once the workers have accepted the request: before, errors get a status
                    await sse.send(events.of_response("response.created", response))
                    await sse.send(events.of_response("response.in_progress", response))
                if u.finish_reason is not None:
                    last = u
                    break
                for event in builder.push(u.text):
                    await sse.send(events.number(event))
    except ApiError as exc:
        if not sse.started:
            raise
        failed = out.finished(response, "failed", builder.items, None, error=out.error_of(exc.message))
        if store:
            await _store_quietly(responses, Stored(failed, conversation, trace))
        await sse.send(events.of_response("response.failed", failed))
        return await sse.done()
    final, closing = finish(gw, gen, builder, response, last.text if last else "", last and last.finish_reason)
    for event in closing:
        await sse.send(events.number(event))
    if store:
        await _store_quietly(responses, Stored(final, conversation, trace))
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"],
                                                                                         "response.failed")
    await sse.send(events.of_response(kind, final))
    return await sse.done()


async def _store_quietly(responses: Responses, record: Stored) -> None:
    """Store a streamed response: its events are already out, so a store that fails is logged, not raised."""
    try:
        await responses.store.put(record)
    except (RedisError, OSError) as exc:
        log.warning("response %s could not be stored: %s", record.response["id"], exc)


# ---------------------------------------------------------------- background
async def run_background(gw: Gateway, responses: Responses, job: Job, plan: ToolPlan, queued: dict,
                         conversation: list[dict]) -> None:
    """Run a background response to its end; a cancel (here or on another replica) ends it at once."""
    store, rid = responses.store, queued["id"]
    running = {**queued, "status": "in_progress"}
    watcher = None
    try:
        await gw.backend.door.passage()  # admitted when it was queued; a weight update may be under way since
        with gw.backend.generation(job) as gen:
            if not await store.update(running, when=("queued",)):
                return  # cancelled or deleted meanwhile
            watcher = asyncio.create_task(_watch_cancel(store, rid, asyncio.current_task()))
            results = await gen.collect()
        final, _ = finish(gw, gen, out.OutputBuilder(gw.reasoning_parser, plan), running, results[0].text,
                          results[0].finish_reason)
    except ApiError as exc:
        final = out.finished(running, "failed", [], None, error=out.error_of(exc.message))
    except asyncio.CancelledError:
        # A cancel already wrote its status (the update below then changes nothing); the gateway stopping did not.
        final = out.finished(running, "failed", [], None, error=out.error_of("The gateway stopped before the "
                                                                             "response was complete."))
        await _end(store, final)
        raise
    except Exception:
        log.exception("background response %s failed", rid)
        final = out.finished(running, "failed", [], None, error=out.error_of("Internal server error."))
    finally:
        if watcher is not None:
            watcher.cancel()
    await _end(store, final)


async def _end(store: ResponseStore, final: dict) -> None:
    try:
        await asyncio.shield(store.update(final, when=IN_FLIGHT))
    except (RedisError, OSError) as exc:
        log.warning("background response %s could not be stored: %s", final["id"], exc)


async def _watch_cancel(store: ResponseStore, rid: str, task: asyncio.Task | None) -> None:
    """Cancel `task` once the stored response says cancelled (or is gone): a cancel sent to another replica."""
    while True:
        await asyncio.sleep(CANCEL_POLL_S)
        try:
            record = await store.get(rid)
        except (RedisError, OSError):
            continue
        if (record is None or record.response["status"] == "cancelled") and task is not None:
            task.cancel()
            return


# ---------------------------------------------------------------- stored responses
async def get_response(request: web.Request) -> web.Response:
    record = await request.app[RESPONSES].read(request.match_info["response_id"])
    return web.json_response(record.response)


async def delete_response(request: web.Request) -> web.Response:
    responses = request.app[RESPONSES]
    rid = request.match_info["response_id"]
    await responses.read(rid)
    await responses.call(responses.store.delete(rid))
    task = responses.running.get(rid)
    if task is not None:
        task.cancel()
    return web.json_response({"id": rid, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    responses = request.app[RESPONSES]
    rid = request.match_info["response_id"]
    record = await responses.read(rid)
    if not record.response.get("background"):
        raise ApiError(400, "Only responses created with 'background': true can be cancelled.", "response_id")
    status = record.response["status"]
    if status in IN_FLIGHT:
        cancelled = {**record.response, "status": "cancelled"}
        if await responses.call(responses.store.update(cancelled, when=IN_FLIGHT)):
            task = responses.running.get(rid)
            if task is not None:
                task.cancel()
            return web.json_response(cancelled)
        record = await responses.read(rid)
        status = record.response["status"]
    if status != "cancelled":
        raise ApiError(400, f"Cannot cancel a response that is already {status}.", "response_id")
    return web.json_response(record.response)


async def list_input_items(request: web.Request) -> web.Response:
    record = await request.app[RESPONSES].read(request.match_info["response_id"])
    query = request.query
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST:
        raise ApiError(400, f"Invalid value for 'limit': an integer from 1 to {MAX_LIST}.", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "Invalid value for 'order': 'asc' or 'desc'.", "order")
    items = record.input if order == "asc" else record.input[::-1]
    for cursor in ("after", "before"):
        if cursor in query:
            at = next((i for i, item in enumerate(items) if item.get("id") == query[cursor]), None)
            if at is None:
                raise ApiError(400, f"Invalid value for {cursor!r}: no input item of this response has the id "
                                    f"{query[cursor]!r}.", cursor)
            items = items[at + 1:] if cursor == "after" else items[:at]
    page = items[:limit] if "before" not in query else items[-limit:]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


def add_routes(app: web.Application, store: ResponseStore | None = None) -> None:
    responses = app[RESPONSES] = Responses(store or MemoryResponses())
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)

    async def lifecycle(app: web.Application):
        log.info("stored responses (/v1/responses) are kept %s", responses.store.where)
        yield
        tasks = list(responses.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await responses.store.close()

    app.cleanup_ctx.append(lifecycle)
