"""Prefill-only endpoints: /v1/score (generative model), /v1/embeddings and /encode (embedding model).

Each request becomes one `Pooling.Encode` call: token sequences in, one vector per sequence out (label-token
log-probabilities for a score, the pooled embedding otherwise). It goes to a worker that holds the model's
prefix cache (colocated, or prefill in PD mode): no decode worker is involved and no KV moves. The request's
`model` picks the served model (`served_models`); one of the wrong kind is a 400 naming it, before any worker
is asked. /v1/rerank and /classify live in `classify`, beside this module, and share the helpers here.
"""
from __future__ import annotations

import base64
import math
import struct
import time

from aiohttp import web

from pdserve.services.gateway.apis.context import GATEWAY, Gateway, new_id
from pdserve.services.gateway.apis.served_models import EMBED, GENERATE, MODELS, ServedModel, install
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.protocol import RequestModel, parse
from pdserve.services.gateway.workers.encoding import encode

ENCODING_FORMATS = ("float", "base64")


# ---------------------------------------------------------------- schemas
class ScoreRequest(RequestModel):
    model: str | None = None
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # keep the first k tokens of each input; -1: the context length


class NativeEncodeRequest(RequestModel):
    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | None = None
    truncate_prompt_tokens: int | None = None


# ---------------------------------------------------------------- helpers
TRUNCATE_HINT = "; set 'truncate_prompt_tokens' to cut it"


def truncation(truncate_prompt_tokens: int | None, limit: int) -> int | None:
    """How many tokens an input may keep when the request asks for truncation (-1: all the context holds)."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return limit
    if k < 1:
        raise ApiError(400, f"'truncate_prompt_tokens' must be -1 or at least 1, got {k}.", "truncate_prompt_tokens")
    if k > limit:
        raise ApiError(400, f"'truncate_prompt_tokens' {k} is larger than the model's context length of {limit} "
                            "tokens.", "truncate_prompt_tokens")
    return k


async def input_ids(gw: Gateway, inputs: list[str | list[int]], params: list[str], list_param: str, limit: int,
                    keep: int | None = None) -> list[list[int]]:
    """Token ids of each input (`params`: the field of each), checked against the vocabulary and `limit` (inputs
    may fill the context), their total against --max-request-tokens. Sizes are checked before anything is
    tokenized; large inputs are tokenized on the gateway's thread pool. `keep`: truncate to the first `keep`
    tokens; text is cut by the tokenizer, which keeps its special tokens."""
    size = 0
    for x, param in zip(inputs, params):
        if isinstance(x, str) and keep is None:  # truncated inputs may be longer; the total still bounds them
            gw.inputs.check_text_size(x, param, TRUNCATE_HINT)
        size += len(x)
    gw.limits.text_total(inputs, list_param, gw.tokenizer.max_token_chars)
    if keep is None:
        gw.limits.tokens_total([x for x in inputs if not isinstance(x, str)], list_param)
    seqs = await gw.cpu.run(size, lambda: [_ids(gw, x, param, limit, keep) for x, param in zip(inputs, params)])
    gw.limits.tokens_total(seqs, list_param)
    return seqs


def _ids(gw: Gateway, prompt: str | list[int], param: str, limit: int, keep: int | None = None) -> list[int]:
    """Token ids of one input, checked against the vocabulary and `limit`."""
    if isinstance(prompt, str):
        if keep is None:
            ids = gw.tokenizer.encode(prompt)
        else:
            ids = list(gw.tokenizer.tok.encode(prompt, truncation=True, max_length=keep))
    else:
        ids = list(prompt)[:keep]
        bad = next((t for t in ids if not 0 <= t < gw.tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} in {param!r} is outside the vocabulary "
                                f"(size {gw.tokenizer.vocab_size}).", param)
    if not ids:
        raise ApiError(400, f"The input {param!r} is empty.", param)
    if len(ids) > limit:
        raise ApiError(400, f"The input {param!r} has {len(ids)} tokens, more than the model's context length of "
                            f"{limit} tokens.", param)
    return ids


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


# ---------------------------------------------------------------- /v1/score
async def score(request: web.Request) -> web.Response:
    """SGLang's /v1/score; its refusals carry SGLang's error type for them, "BadRequestError"."""
    try:
        return await _score(request)
    except ApiError as exc:
        if exc.status != 400:
            raise
        raise ApiError(400, exc.message, exc.param, "BadRequestError") from None


async def _score(request: web.Request) -> web.Response:
    body = await read_json(request)
    limits = request.app[GATEWAY].limits
    limits.count(body.get("items"), "max_list_items", "items")
    limits.count(body.get("label_token_ids"), "max_score_labels", "label_token_ids")
    req = parse(ScoreRequest, body)
    gw = (await request.app[MODELS].require(req.model, GENERATE, "/v1/score")).gateway
    if req.query is None:
        raise ApiError(400, "Field 'query' is required.", "query")
    if not req.items:
        raise ApiError(400, "'items' must hold at least one item.", "items")
    if not req.label_token_ids:
        raise ApiError(400, "'label_token_ids' must hold at least one token id.", "label_token_ids")
    bad = next((t for t in req.label_token_ids if not 0 <= t < gw.tokenizer.vocab_size), None)
    if bad is not None:
        # SGLang's words: a client matches on them.
        raise ApiError(400, f"Token ID {bad} is out of vocabulary (vocab size: {gw.tokenizer.vocab_size})",
                       "label_token_ids")
    items = [req.items] if isinstance(req.items, str) else req.items
    limit = gw.backend.context_length()
    # Each item is tokenized with the query: measured before the joined inputs are made.
    size = len(req.query) * len(items) + sum(len(x) for x in items)
    if isinstance(req.query, str):
        gw.inputs.check_text_size(req.query, "query")
        gw.limits.chars_total(size, "items", gw.tokenizer.max_token_chars)
    else:
        if len(req.query) >= limit:
            raise ApiError(400, f"The input 'query' has {len(req.query)} tokens, more than the model's context "
                                f"length of {limit} tokens.", "query")
        gw.limits.tokens_count(size, "items")
    joined = []
    for k, item in enumerate(items):
        if isinstance(req.query, str) != isinstance(item, str):
            raise ApiError(400, "'query' and 'items' must both be text or both be token ids.", f"items.{k}")
        if isinstance(item, str):
            gw.inputs.check_chars(len(req.query) + len(item), f"items.{k}")
        # Text is joined before tokenizing, so the tokenizer sees the boundary as it would see one prompt.
        joined.append(item + req.query if req.item_first else req.query + item)
    seqs = await input_ids(gw, joined, [f"items.{k}" for k in range(len(items))], "items", limit)
    result = await encode(gw.backend, new_id(), seqs, req.label_token_ids)
    scores = [_probabilities(lps, req.apply_softmax) for lps in result.outputs]
    return web.json_response({"scores": scores, "model": req.model or gw.served_model_name,
                              "usage": _usage(result.prompt_tokens), "object": "scoring"})


def _refuse_blank(given: object) -> None:
    """SGLang's 400 for a text with nothing to embed (empty or whitespace only), in its words."""
    if isinstance(given, str) and not given.strip():
        raise ApiError(400, "Input cannot be empty or whitespace only", "input")
    if isinstance(given, list):
        blank = next((k for k, x in enumerate(given) if isinstance(x, str) and not x.strip()), None)
        if blank is not None:
            raise ApiError(400, f"Input at index {blank} cannot be empty or whitespace only", f"input.{blank}")


def _probabilities(logprobs: list[float], renormalise: bool) -> list[float]:
    """The label tokens' probabilities: over the whole vocabulary, or (apply_softmax) over the labels alone."""
    if not renormalise:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


# ---------------------------------------------------------------- /v1/embeddings
async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    request.app[GATEWAY].limits.list_of_prompts(body.get("input"), "input")
    req = parse(EmbeddingRequest, body)
    served = await request.app[MODELS].require(req.model, EMBED, "/v1/embeddings")
    gw = served.gateway
    if req.encoding_format not in ENCODING_FORMATS:
        raise ApiError(400, f"Unknown 'encoding_format' {req.encoding_format!r}; use 'float' or 'base64'.",
                       "encoding_format")
    _check_dimensions(served, req.dimensions)
    inputs = as_list(req.input)
    if not inputs:
        raise ApiError(400, "'input' must hold at least one item.", "input")
    _refuse_blank(req.input)
    limit = gw.backend.context_length()
    keep = truncation(req.truncate_prompt_tokens, limit)
    many = not isinstance(req.input, str) and not (req.input and isinstance(req.input[0], int))
    params = [f"input.{k}" if many else "input" for k in range(len(inputs))]
    seqs = await input_ids(gw, inputs, params, "input", limit, keep)
    result = await encode(gw.backend, new_id(), seqs)
    data = []
    for k, vector in enumerate(result.outputs):
        if req.dimensions is not None and req.dimensions < len(vector):
            vector = _shorten(vector, req.dimensions)
        data.append({"object": "embedding", "index": k,
                     "embedding": _b64(vector) if req.encoding_format == "base64" else vector})
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return web.json_response({"object": "list", "data": data, "model": req.model or gw.served_model_name,
                              "usage": usage})


def as_list(value) -> list:
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]  # one input given as token ids
    return list(value)


def _check_dimensions(served: ServedModel, dimensions: int | None) -> None:
    if dimensions is None:
        return
    size = served.dimension
    if dimensions < 1:
        raise ApiError(400, f"'dimensions' must be at least 1, got {dimensions}.", "dimensions")
    if size is not None and dimensions > size:
        raise ApiError(400, f"'dimensions' {dimensions} is larger than the {size} dimensions of the model "
                            f"{served.name!r}.", "dimensions")
    if dimensions == size:
        return
    if not served.matryoshka:
        raise ApiError(400, f"The model {served.name!r} does not support 'dimensions' (it was not trained "
                            f"for Matryoshka truncation); leave it out or ask for {size}.", "dimensions")
    if served.matryoshka_dims and dimensions not in served.matryoshka_dims:
        raise ApiError(400, f"'dimensions' must be one of {list(served.matryoshka_dims)} for the model "
                            f"{served.name!r}.", "dimensions")


def _shorten(vector: list[float], dimensions: int) -> list[float]:
    """The leading `dimensions` values of a Matryoshka embedding, back at unit length."""
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def _b64(vector: list[float]) -> str:
    """OpenAI's base64 form: the float32 values, little-endian, as one base64 string."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


# ---------------------------------------------------------------- /encode
async def native_encode(request: web.Request) -> web.Response:
    return await answer_native(request, EMBED, "/encode")


async def answer_native(request: web.Request, kind: str, endpoint: str) -> web.Response:
    """/encode and /classify: one output vector per input, in SGLang's native shape (one object for one input)."""
    body = await read_json(request)
    limits = request.app[GATEWAY].limits
    limits.list_of_prompts(body.get("text"), "text")
    limits.list_of_prompts(body.get("input_ids"), "input_ids")
    req = parse(NativeEncodeRequest, body)
    gw = (await request.app[MODELS].require(req.model, kind, endpoint)).gateway
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "Give exactly one of 'text' and 'input_ids'.", "text")
    given = req.text if req.text is not None else req.input_ids
    param = "text" if req.text is not None else "input_ids"
    inputs = as_list(given)
    batch = not isinstance(given, str) and not (given and isinstance(given[0], int))
    if not inputs:
        raise ApiError(400, f"'{param}' must hold at least one item.", param)
    limit = gw.backend.context_length()
    keep = truncation(req.truncate_prompt_tokens, limit)
    seqs = await input_ids(gw, inputs, [f"{param}.{k}" if batch else param for k in range(len(inputs))], param,
                           limit, keep)
    start = time.perf_counter()
    result = await encode(gw.backend, new_id(), seqs)
    rid = req.rid or new_id()
    latency = round(time.perf_counter() - start, 6)
    outputs = [{"embedding": vector,
                "meta_info": {"id": f"{rid}-{k}" if batch else rid, "finish_reason": {"type": "length", "length": 0},
                              "prompt_tokens": len(seq), "e2e_latency": latency}}
               for k, (vector, seq) in enumerate(zip(result.outputs, seqs))]
    return web.json_response(outputs if batch else outputs[0])


def add_routes(app: web.Application, extra_models: list[Gateway]) -> None:
    """The routes here; /v1/rerank and /classify, which build on them, are added by classify.py."""
    install(app, extra_models)
    app.router.add_post("/v1/score", score)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/encode", native_encode)
