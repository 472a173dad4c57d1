"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Each handler validates (protocol.py), tokenizes, turns the request into one Job per prompt (intake), admits,
runs one generation per prompt (the worker does n > 1) and answers in OpenAI's shape, streamed as SSE or whole.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from pdserve.services import tracing
from pdserve.services.gateway import intake
from pdserve.services.gateway.apis import openai_format as fmt
from pdserve.services.gateway.apis.context import GATEWAY, SSE, Gateway, json_answer, new_id
from pdserve.services.gateway.apis.served_models import MODELS
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.dialects import OPENAI_CHAT, OPENAI_COMPLETION
from pdserve.services.gateway.intake.protocol import (ChatCompletionRequest, CompletionRequest, parse, per_prompt,
                                                      refuse_unsupported)
from pdserve.services.gateway.intake.reasoning import ReasoningSplitter, split_text
from pdserve.services.gateway.intake.tool_calls import ToolPlan, plan_tools, template_messages
from pdserve.services.gateway.tokenization import ReservedTemplateKwarg
from pdserve.services.gateway.workers.fan_in import merge_updates
from pdserve.services.gateway.workers.job import Job, Update


def cached_report(gw: Gateway, cached: int) -> int | None:
    """usage.prompt_tokens_details.cached_tokens: only with --enable-cache-report, as SGLang (a client's
    return_cached_tokens_details alone does not turn it on): another client's prompts answer from the same cache,
    and how much of a guessed prompt is cached tells what they sent."""
    return cached if gw.enable_cache_report else None


# ---------------------------------------------------------------- chat
async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    body = await read_json(request)
    refuse_unsupported(body)
    gw.limits.chat(body)  # before anything is parsed or rendered
    req = parse(ChatCompletionRequest, body)
    if isinstance(req.lora_path, list):
        raise ApiError(400, "'lora_path' of a chat completion is one adapter, not a list.", "lora_path")
    lora = await gw.adapter_of(req.model, req.lora_path)
    tools = plan_tools(req, gw.tool_call_parser)
    messages = template_messages(req.template_messages())
    # The rendered prompt holds every message's text: more than the context can hold is refused unrendered.
    chars = sum(len(m["content"]) for m in messages)
    gw.inputs.check_chars(chars, "messages")
    try:
        with tracing.section("tokenize", messages=len(messages)):
            ids = await gw.cpu.run(chars + 64 * len(messages), _render_ids, gw, req, messages, tools)
    except ReservedTemplateKwarg as exc:
        raise ApiError(400, str(exc), f"chat_template_kwargs.{exc.name}") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages") from None
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' to be true.", "top_logprobs")
    asked = next((v for v in (req.max_completion_tokens, req.max_tokens) if v is not None), None)
    parser = gw.reasoning_parser if req.separate_reasoning else None
    job = await intake.job(gw.inputs, OPENAI_CHAT, req, ids, rid=new_id(), lora=lora, max_tokens=asked,
                           public_id=req.rid or "", response_format=req.response_format, tools=tools,
                           reasoning_parser=parser, return_logprob=req.logprobs,
                           top_logprobs_num=req.top_logprobs or 0,
                           renamed={"max_new_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None
                           else None)
    await gw.backend.admit()
    with gw.backend.generation(job) as gen:
        if req.stream:
            return await _stream_chat(request, gw, req, job, gen, parser, tools)
        results = await gen.collect()
    entries = sum(len(r.logprobs) for r in results) * (1 + (req.top_logprobs or 0)) if req.logprobs else 0
    return await json_answer(request, entries, lambda: _chat_answer(gw, req, job, gen, results, parser, tools))


def _chat_answer(gw: Gateway, req: ChatCompletionRequest, job: Job, gen, results: list, parser: str | None,
                 tools: ToolPlan) -> dict:
    """The whole chat completion (on the gateway's pool when it holds many logprobs: `json_answer`)."""
    choices, reasoning_tokens = [], 0
    for r in results:
        content, reasoning = r.text, None
        if parser is not None:
            split = split_text(parser, r.text)
            content, reasoning = split.content, split.reasoning or None
            reasoning_tokens += len(gw.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        lps = fmt.chat_logprobs(gw.tokenizer, r.logprobs) if req.logprobs else None
        calls = tools.stream()
        if calls is None:
            choices.append(fmt.chat_choice(r, content, reasoning, lps))
            continue
        calls.push(content or "", final=True)
        choices.append(fmt.chat_choice(r, calls.message_content(), reasoning, lps, calls.message_calls(),
                                       calls.finish_reason(r.finish_reason, r.matched_stop)))
    usage = fmt.usage(gen.prompt_tokens, gen.completion_tokens, cached_report(gw, gen.cached_tokens),
                      reasoning_tokens)
    return fmt.chat_completion(job.public_id, int(time.time()), req.model or gw.served_model_name, choices, usage)


def _render_ids(gw: Gateway, req: ChatCompletionRequest, messages: list[dict], tools: ToolPlan) -> list[int]:
    """The prompt's token ids: the chat template rendered, then tokenized (on the gateway's pool when large)."""
    text = gw.tokenizer.render_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message,
                                    template_kwargs=req.chat_template_kwargs, tools=tools.template_tools)
    # The rendered template already holds any special tokens it wants (BOS included): add none.
    return gw.inputs.prompt_ids(text, "messages", add_special_tokens=False)


async def _stream_chat(request: web.Request, gw: Gateway, req: ChatCompletionRequest, job: Job, gen,
                       parser: str | None, tools: ToolPlan) -> web.StreamResponse:
    created, model = int(time.time()), req.model or gw.served_model_name
    sse = SSE(request)
    splitters = [ReasoningSplitter(parser) if parser else None for _ in range(req.n)]
    call_streams = [tools.stream() for _ in range(req.n)]
    reasoning_tokens = 0
    try:
        async with contextlib.aclosing(gen.updates()) as updates:
            async for u in updates:
                if not sse.started:  # the role comes first, once the workers have accepted the request
                    for i in range(req.n):
                        await sse.send(fmt.chat_chunk(job.public_id, created, model,
                                                      [fmt.chunk_choice(i, {"role": "assistant", "content": ""})]))
                splitter = splitters[u.index]
                if splitter is not None and splitter.in_reasoning:
                    reasoning_tokens += len(u.token_ids)
                delta = _chat_delta(u, splitter)
                finish = u.finish_reason, u.matched_stop
                if (calls := call_streams[u.index]) is not None:
                    delta = calls.push_delta(delta, final=u.finish_reason is not None)
                    finish = calls.finish_reason(*finish)
                lps = fmt.chat_logprobs(gw.tokenizer, u.logprobs) if req.logprobs and u.logprobs else None
                if delta or lps or u.finish_reason is not None:
                    running = fmt.usage(gen.prompt_tokens, gen.completion_tokens, None) \
                        if req.continuous_usage else None
                    await sse.send(fmt.chat_chunk(job.public_id, created, model, [
                        fmt.chunk_choice(u.index, delta, lps, *finish)], running))
    except ApiError as exc:
        return await sse.fail(exc)
    if req.include_usage:
        usage = fmt.usage(gen.prompt_tokens, gen.completion_tokens, cached_report(gw, gen.cached_tokens),
                          reasoning_tokens)
        await sse.send(fmt.chat_chunk(job.public_id, created, model, [], usage))
    return await sse.done()


def _chat_delta(u: Update, splitter: ReasoningSplitter | None) -> dict:
    if splitter is None:
        return {"content": u.text} if u.text else {}
    split = splitter.push(u.text, final=u.finish_reason is not None)
    delta = {}
    if split.reasoning:
        delta["reasoning_content"] = split.reasoning
    if split.content:
        delta["content"] = split.content
    return delta


# ---------------------------------------------------------------- completions
async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    body = await read_json(request)
    refuse_unsupported(body)
    gw.limits.list_of_prompts(body.get("prompt"), "prompt")
    gw.limits.sampling(body)
    req = parse(CompletionRequest, body)
    prompts = req.prompts()
    many = len(prompts) > 1
    loras = [await gw.adapter_of(req.model, path)
             for path in per_prompt(req.lora_path, len(prompts), "lora_path")]
    ids_list = await gw.inputs.prompts_ids(prompts, [f"prompt.{k}" if many else "prompt" for k in range(len(prompts))],
                                    "prompt")
    rid = req.rid or new_id()  # the answer's id; each prompt's job has its own server-side id
    base = new_id()
    jobs = []
    for k, ids in enumerate(ids_list):
        jobs.append(await intake.job(gw.inputs, OPENAI_COMPLETION, req, ids, rid=f"{base}-{k}" if many else base,
                                     lora=loras[k], max_tokens=req.max_tokens, public_id=rid,
                                     response_format=req.response_format, return_logprob=req.logprobs is not None,
                                     top_logprobs_num=req.logprobs or 0,
                                     logprob_start_len=0 if req.echo else -1))  # echo: the prompt's logprobs too
    echoes = [(p if isinstance(p, str) else gw.tokenizer.decode(ids, False)) if req.echo else ""
              for p, ids in zip(prompts, ids_list)]
    await gw.backend.admit(len(jobs))
    with contextlib.ExitStack() as stack:
        gens = [stack.enter_context(gw.backend.generation(job)) for job in jobs]
        if req.stream:
            return await _stream_completions(request, gw, req, rid, gens, echoes)
        results = await asyncio.gather(*(g.collect() for g in gens))
    entries = 0 if req.logprobs is None else (1 + req.logprobs) * sum(
        len(r.logprobs) + (len(gen.job.input_ids) if req.echo else 0) for gen, rs in zip(gens, results) for r in rs)
    return await json_answer(request, entries, lambda: _completion_answer(gw, req, rid, gens, results, echoes))


def _completion_answer(gw: Gateway, req: CompletionRequest, rid: str, gens: list, results: list,
                       echoes: list[str]) -> dict:
    """The whole completion (on the gateway's pool when it holds many logprobs: `json_answer`)."""
    choices = []
    for k, rs in enumerate(results):
        for r in rs:
            lps = fmt.completion_logprobs(gw.tokenizer, r.logprobs, len(echoes[k]), bool(req.logprobs)) \
                if req.logprobs is not None else None
            if lps is not None and req.echo:
                lps = fmt.join_logprobs(_echo_logprobs(gw, req, gens[k]), lps)
            choices.append(fmt.completion_choice(k * req.n + r.index, echoes[k] + r.text, lps, r.finish_reason,
                                                 r.matched_stop))
    usage = fmt.usage(sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens),
                      cached_report(gw, sum(g.cached_tokens for g in gens)))
    return fmt.completion(rid, int(time.time()), req.model or gw.served_model_name, choices, usage)


def _echo_logprobs(gw: Gateway, req: CompletionRequest, gen) -> dict:
    return fmt.prompt_completion_logprobs(gw.tokenizer, gen.job.input_ids, gen.input_logprobs, bool(req.logprobs))


async def _stream_completions(request: web.Request, gw: Gateway, req: CompletionRequest, rid: str, gens: list,
                              echoes: list[str]) -> web.StreamResponse:
    created, model = int(time.time()), req.model or gw.served_model_name
    sse = SSE(request)
    offsets = {k * req.n + i: len(echo) for k, echo in enumerate(echoes) for i in range(req.n)}
    echoed: set[int] = set()
    try:
        async for k, u in merge_updates(gens):
            if echoes[k] and k not in echoed:  # a prompt comes first, once its worker answered (with its logprobs)
                echoed.add(k)
                entries = 0 if req.logprobs is None else len(gens[k].job.input_ids) * (1 + req.logprobs)
                lps = None if req.logprobs is None else await gw.cpu.run(entries, _echo_logprobs, gw, req, gens[k])
                for i in range(req.n):
                    await sse.send(fmt.completion(rid, created, model, [
                        fmt.completion_choice(k * req.n + i, echoes[k], lps, None, None)], None), entries)
            index = k * req.n + u.index
            lps = None
            if req.logprobs is not None and u.logprobs:
                lps = fmt.completion_logprobs(gw.tokenizer, u.logprobs, offsets[index], bool(req.logprobs))
            offsets[index] += len(u.text)
            if u.text or lps or u.finish_reason is not None:
                running = fmt.usage(sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens),
                                    None) if req.continuous_usage else None
                await sse.send(fmt.completion(rid, created, model, [
                    fmt.completion_choice(index, u.text, lps, u.finish_reason, u.matched_stop)], running))
    except ApiError as exc:
        return await sse.fail(exc)
    if req.include_usage:
        usage = fmt.usage(sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens),
                          cached_report(gw, sum(g.cached_tokens for g in gens)))
        await sse.send(fmt.completion(rid, created, model, [], usage))
    return await sse.done()


# ---------------------------------------------------------------- models
async def list_models(request: web.Request) -> web.Response:
    # Every served model: the gateway's own first, then any pooling model beside it (--embedding-model).
    return web.json_response({"object": "list", "data": await request.app[MODELS].cards()})


async def retrieve_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    model = next((m for m in request.app[MODELS].models if name in m.gateway.accepted_model_names), None)
    if model is None:
        card = next((c for c in await request.app[MODELS].cards() if c["id"] == name), None)
        if card is None:
            raise ApiError(404, f"The model {name!r} does not exist.", "model")
        return web.json_response(card)  # a LoRA adapter
    gw = model.gateway
    return web.json_response(fmt.model_card(gw.served_model_name, gw.created, gw.backend.context_length()))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
