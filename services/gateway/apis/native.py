"""SGLang's native endpoints: /generate, model and server info, health, cache, tokenizer, abort, metrics."""
from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from pdserve.services.gateway import intake
from pdserve.services.gateway.apis.context import GATEWAY, SSE, WEIGHT_VERSION, Gateway, json_answer, new_id
from pdserve.services.gateway.apis.native_logprobs import output_logprob_meta, prompt_logprob_meta, token_ids_logprob
from pdserve.services.gateway.apis.served_models import GENERATE, MODELS
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.dialects import NATIVE
from pdserve.services.gateway.intake.protocol import (UNSUPPORTED_NATIVE_SAMPLING, UNSUPPORTED_OPENAI, AbortRequestBody,
                                                      ChatCompletionRequest, DetokenizeRequest, GenerateRequest,
                                                      NativeSampling, TokenizeRequest, parse, per_prompt,
                                                      refuse_unsupported)
from pdserve.services.gateway.intake.tool_calls import plan_tools, template_messages
from pdserve.services.gateway.siblings import SIBLINGS
from pdserve.services.gateway.tokenization import ReservedTemplateKwarg
from pdserve.services.gateway.workers.fan_in import merge_updates
from pdserve.services.gateway.workers.generation import Generation
from pdserve.services.gateway.workers.job import ChoiceResult, Job
from pdserve.shared.config import CACHE_TIERS
from pdserve.shared.kv_events import cached_by_tier
from pdserve.shared.sampling_params import SamplingParams

UNSUPPORTED_GENERATE = {k: UNSUPPORTED_OPENAI[k] for k in (
    "image_data", "audio_data", "video_data", "input_embeds", "return_hidden_states",
    "custom_logit_processor")}
VERSION = "0.1.0"


# ---------------------------------------------------------------- /generate
async def _jobs(gw: Gateway, req: GenerateRequest) -> tuple[list[Job], bool, list[bool], list[int]]:
    """(one Job per prompt, whether the request is a batch, return_logprob per prompt, stream_interval per
    prompt)."""
    prompts, batch = req.prompts()
    count = len(prompts)
    sps = per_prompt(req.sampling_params or {}, count, "sampling_params")
    logprob_flags = [bool(x) for x in per_prompt(req.return_logprob, count, "return_logprob")]
    tops = per_prompt(req.top_logprobs_num, count, "top_logprobs_num")
    starts = per_prompt(req.logprob_start_len, count, "logprob_start_len")
    named = token_ids_logprob(req.token_ids_logprob, count, batch, gw.tokenizer.vocab_size)
    rids = per_prompt(req.rid, count, "rid") if req.rid is not None else None
    loras = [await gw.adapter_of(req.model, path) for path in per_prompt(req.lora_path, count, "lora_path")]
    if rids is not None and batch and len(set(rids)) != len(rids):
        raise ApiError(400, "'rid' must be different for every prompt.", "rid")
    base = new_id()
    jobs, intervals = [], []
    params = [f"text.{k}" if batch and req.text is not None else ("input_ids" if req.text is None else "text")
              for k in range(count)]
    ids_list = await gw.inputs.prompts_ids(prompts, params, "text" if req.text is not None else "input_ids")
    for k, (prompt, ids) in enumerate(zip(prompts, ids_list)):
        prefix = f"sampling_params.{k}." if isinstance(req.sampling_params, list) else "sampling_params."
        refuse_unsupported(sps[k], UNSUPPORTED_NATIVE_SAMPLING, prefix)
        sp = parse(NativeSampling, sps[k], prefix.rstrip("."))
        start = -1 if starts[k] is None or not logprob_flags[k] else starts[k]
        if start >= len(ids):
            raise ApiError(400, f"'logprob_start_len' ({start}) must be smaller than the prompt's {len(ids)} tokens.",
                           "logprob_start_len")
        rid = f"{base}-{k}" if batch else base  # the client's rid is only its name for the request (Job)
        jobs.append(await intake.job(gw.inputs, NATIVE, sp, ids, rid=rid, lora=loras[k], max_tokens=sp.max_new_tokens,
                                     public_id=rids[k] if rids is not None else "", prefix=prefix,
                                     return_logprob=logprob_flags[k], top_logprobs_num=tops[k],
                                     logprob_start_len=start, token_ids_logprob=named[k],
                                     cache_salt=req.cache_salt))
        intervals.append(sp.stream_interval or 1)
    return jobs, batch, logprob_flags, intervals


def _check_limits(gw: Gateway, body: dict) -> None:
    """The request's limits, on the raw body: its prompts and each prompt's sampling_params."""
    gw.limits.list_of_prompts(body.get("text"), "text")
    gw.limits.list_of_prompts(body.get("input_ids"), "input_ids")
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        gw.limits.count(sps, "max_list_items", "sampling_params")
        for k, sp in enumerate(sps):
            gw.limits.sampling(sp, f"sampling_params.{k}.")
    else:
        gw.limits.sampling(sps, "sampling_params.")


def _finish(r: ChoiceResult, tokens: int) -> dict | None:
    if r.finish_reason is None:
        return None
    if r.finish_reason == "length":
        return {"type": "length", "length": tokens}
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    return {"type": "abort", "message": "The request was aborted."}


def _output(gw: Gateway, req: GenerateRequest, job: Job, gen: Generation, r: ChoiceResult, logprob: bool) -> dict:
    tokens = len(r.token_ids)
    meta = {"id": job.public_id, "finish_reason": _finish(r, tokens), "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": tokens, "cached_tokens": gen.cached_tokens,
            "cached_tokens_details": cached_details(gen), "e2e_latency": round(gen.e2e_latency, 6)}
    if logprob:
        meta.update(output_logprob_meta(gw.tokenizer, r.logprobs, req.return_text_in_logprobs, job.params,
                                        gen.next_ids_logprobs))
        if job.params.wants_prompt_logprobs:
            meta.update(prompt_logprob_meta(gw.tokenizer, job, gen.input_logprobs, req.return_text_in_logprobs))
    return {"text": r.text, "output_ids": list(r.token_ids), "meta_info": meta}


def cached_details(gen: Generation) -> dict:
    """SGLang's meta_info.cached_tokens_details: where the cached tokens came from (the pool, or put back into it
    for this request from the host-memory or the storage tier)."""
    return cached_by_tier(gen.cached_tokens, gen.cached_by_tier)


async def generate(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    body = await read_json(request)
    refuse_unsupported(body, UNSUPPORTED_GENERATE)
    _check_limits(gw, body)
    req = parse(GenerateRequest, body)
    jobs, batch, logprob_flags, intervals = await _jobs(gw, req)
    await gw.backend.admit(len(jobs))
    with contextlib.ExitStack() as stack:
        gens = [stack.enter_context(gw.backend.generation(job)) for job in jobs]
        if req.stream:
            return await _stream_generate(request, gw, req, jobs, gens, logprob_flags, intervals)
        results = await asyncio.gather(*(g.collect() for g in gens))
    single = not batch and sum(map(len, results)) == 1
    entries = sum((len(r.logprobs) + len(gen.input_logprobs))
                  * (1 + job.params.top_logprobs_num + len(job.params.token_ids_logprob))
                  for job, gen, rs, flag in zip(jobs, gens, results, logprob_flags) if flag for r in rs)

    def answer() -> dict | list[dict]:  # on the gateway's pool when it holds many logprobs (`json_answer`)
        outputs = [_output(gw, req, job, gen, r, flag)
                   for job, gen, rs, flag in zip(jobs, gens, results, logprob_flags) for r in rs]
        return outputs[0] if single else outputs

    return await json_answer(request, entries, answer)


async def _stream_generate(request: web.Request, gw: Gateway, req: GenerateRequest, jobs: list[Job],
                           gens: list[Generation], logprob_flags: list[bool],
                           intervals: list[int]) -> web.StreamResponse:
    """Each event holds the whole output so far (SGLang's native stream); one event per `stream_interval`
    new tokens of a choice, and one when it finishes."""
    sse = SSE(request)
    so_far = {(k, i): ChoiceResult(i) for k, job in enumerate(jobs) for i in range(job.params.n)}
    sent = dict.fromkeys(so_far, 0)  # tokens of each choice already streamed
    indexed = len(so_far) > 1
    try:
        async for k, u in merge_updates(gens):
            acc = so_far[(k, u.index)]
            acc.add(u)
            if u.finish_reason is None and len(acc.token_ids) - sent[(k, u.index)] < intervals[k]:
                continue
            sent[(k, u.index)] = len(acc.token_ids)
            out = _output(gw, req, jobs[k], gens[k], acc, logprob_flags[k])
            if indexed:
                out["index"] = k * jobs[k].params.n + u.index
            await sse.send(out)
    except ApiError as exc:
        return await sse.fail(exc)
    return await sse.done()


# ---------------------------------------------------------------- info and health
async def get_model_info(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response({
        "model_path": gw.model_path, "tokenizer_path": gw.tokenizer_path,
        "is_generation": request.app[MODELS].primary.kind == GENERATE,
        "preferred_sampling_params": None, "weight_version": request.app[WEIGHT_VERSION](),
        "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": gw.model_config.model_type,
        "architectures": gw.model_config.architectures or None})


async def get_server_info(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    backend = gw.backend
    generating = [w for w in backend.generating_workers() if w.info is not None]
    return web.json_response({
        **gw.server_args, "version": VERSION, "mode": backend.mode,
        "context_length": backend.context_length(),
        "max_total_num_tokens": sum(w.info.max_total_tokens for w in generating),
        "internal_states": [{"running_requests": backend.in_flight, "queued_requests": backend.queued}],
        "workers": [w.describe() for w in backend.workers()]})


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not await gw.backend.served():
        raise ApiError(503, "No healthy worker is available.")
    return web.Response(text="")


async def live(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP. Unlike /health it does not ask for a healthy worker pair, so an
    orchestrator restarts a gateway that hangs, not one whose workers are down (or that is draining)."""
    return web.Response(text="ok")


async def health_generate(request: web.Request) -> web.Response:
    """Generate one token through a real worker pair."""
    gw = request.app[GATEWAY]
    ids = gw.tokenizer.encode("Hello", add_special_tokens=True)
    job = Job(f"health-{new_id()}", ids, SamplingParams(temperature=0.0, max_new_tokens=1))
    try:
        await gw.backend.admit()
        with gw.backend.generation(job) as gen:
            results = await asyncio.wait_for(gen.collect(), timeout=30)
    except asyncio.TimeoutError:
        raise ApiError(503, "The workers did not generate a token within 30 s.") from None
    except ApiError as exc:
        raise ApiError(503, f"Generation health check failed: {exc.message}") from None
    if not results or not results[0].token_ids:
        raise ApiError(503, "Generation health check produced no token.")
    return web.Response(text="")


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache; `?tiers=device` (or `storage`, comma-separated or repeated) empties only those tiers
    of cached KV, every tier by default."""
    gw = request.app[GATEWAY]
    tiers = flush_tiers(request)
    results = await gw.backend.flush_cache(tiers)
    flushed = [addr for addr, ok, _ in results if ok]
    if flushed and SIBLINGS in request.app and (not tiers or "device" in tiers):
        # their routers too send prompts by the prefixes that are gone
        await request.app[SIBLINGS].tell("forget", {"addresses": flushed}, gw.backend.settings.rpc_timeout_s)
    failed = [f"{addr}: {msg}" for addr, ok, msg in results if not ok]
    if not results:
        raise ApiError(503, "No worker to flush.")
    if failed:
        raise ApiError(400, "Cache not flushed on every worker (it is not flushed while requests are running): "
                       + "; ".join(failed))
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                             "or waiting requests, the operation will not be performed.)\n")


def flush_tiers(request: web.Request) -> tuple[str, ...]:
    names = [t.strip() for value in request.query.getall("tiers", []) for t in value.split(",") if t.strip()]
    unknown = [t for t in names if t not in CACHE_TIERS]
    if unknown:
        raise ApiError(400, f"tiers: unknown tier {unknown[0]!r} (known: {', '.join(CACHE_TIERS)})", param="tiers")
    return tuple(dict.fromkeys(names))


# ---------------------------------------------------------------- tokenizer
async def tokenize(request: web.Request) -> web.Response:
    """SGLang's /tokenize (and /v1/tokenize): the ids of a `prompt`, or of the prompt a chat completion of
    `messages` would run."""
    gw = request.app[GATEWAY]
    body = await read_json(request)
    req = parse(TokenizeRequest, body)
    await gw.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "Exactly one of 'prompt' or 'messages' must be provided.", "prompt")
    encode = gw.tokenizer.encode
    limit = gw.backend.context_length()
    if req.messages is not None:
        tokens = await _chat_prompt_ids(gw, body)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": limit})
    if isinstance(req.prompt, str):
        gw.inputs.check_text_size(req.prompt, "prompt")
        tokens = await gw.cpu.run(len(req.prompt), encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": limit})
    gw.limits.count(req.prompt, "max_list_items", "prompt")
    for k, p in enumerate(req.prompt):
        gw.inputs.check_text_size(p, f"prompt.{k}")
    gw.limits.text_total(req.prompt, "prompt", gw.tokenizer.max_token_chars)
    lists = await gw.cpu.run(sum(map(len, req.prompt)), lambda: [
        encode(p, add_special_tokens=req.add_special_tokens) for p in req.prompt])
    return web.json_response({"tokens": lists, "count": [len(t) for t in lists], "max_model_len": limit})


async def _chat_prompt_ids(gw: Gateway, body: dict) -> list[int]:
    """The ids of the prompt /v1/chat/completions renders from `body`: the chat template over its messages, with
    its tools unless tool_choice is "none" (the rendered template holds its special tokens: none are added)."""
    gw.limits.chat(body)
    chat = parse(ChatCompletionRequest, {k: v for k, v in body.items() if k not in ("prompt", "add_special_tokens")})
    tools = plan_tools(chat, gw.tool_call_parser)
    messages = template_messages(chat.template_messages())
    chars = sum(len(m["content"]) for m in messages)
    gw.inputs.check_chars(chars, "messages")

    def render() -> list[int]:
        text = gw.tokenizer.render_chat(messages, add_generation_prompt=chat.add_generation_prompt,
                                        continue_final_message=chat.continue_final_message,
                                        template_kwargs=chat.chat_template_kwargs, tools=tools.template_tools)
        return gw.tokenizer.encode(text, add_special_tokens=False)

    try:
        return await gw.cpu.run(chars + 64 * len(messages), render)
    except ReservedTemplateKwarg as exc:
        raise ApiError(400, str(exc), f"chat_template_kwargs.{exc.name}") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages") from None


async def detokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse(DetokenizeRequest, await read_json(request))
    await gw.check_model(req.model)
    tok = gw.tokenizer
    single = not (req.tokens and isinstance(req.tokens[0], list))
    lists = [req.tokens] if single else req.tokens
    if not single:
        gw.limits.count(lists, "max_list_items", "tokens")
    gw.limits.tokens_total(lists, "tokens")
    for ids in lists:
        bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} in 'tokens' is outside the vocabulary (size {tok.vocab_size}).",
                           "tokens")
    texts = await gw.cpu.run(sum(map(len, lists)), lambda: [tok.decode(ids, req.skip_special_tokens) for ids in lists])
    return web.json_response({"text": texts[0] if single else texts})


# ---------------------------------------------------------------- abort and metrics
async def abort_request(request: web.Request) -> web.Response:
    req = parse(AbortRequestBody, await read_json(request))
    if not (req.abort_all or req.rid):
        raise ApiError(400, "Give 'rid' (or 'abort_all': true).", "rid")
    # The workers find the requests sent under this id (or all of them) whichever gateway, replica or process
    # sent them. An admin route: the key every client has cannot end another client's request.
    aborted = await request.app[GATEWAY].backend.abort(req.rid, req.abort_all)
    return web.json_response({"rid": req.rid, "aborted": aborted})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    for w in gw.backend.workers():
        gw.backend.metrics.workers_healthy.labels(w.role, w.address).set(1 if w.healthy else 0)
    gw.backend.metrics.queued.set(gw.backend.queued)
    return gw.backend.metrics.render()


def add_routes(app: web.Application) -> None:
    if SIBLINGS in app:
        gw = app[GATEWAY]

        async def forget_for_sibling(body: dict) -> dict:
            for address in body["addresses"]:
                gw.backend.router.forget(address)
            return {}

        app[SIBLINGS].handle("forget", forget_for_sibling)
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/server_info", get_server_info)  # SGLang's current name; /get_server_info the older
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/flush_cache", flush_cache)
    for prefix in ("", "/v1"):  # SGLang serves both
        app.router.add_post(prefix + "/tokenize", tokenize)
        app.router.add_post(prefix + "/detokenize", detokenize)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/metrics", metrics)
