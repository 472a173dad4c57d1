"""Sequence-classification endpoints: /v1/rerank (cross-encoders) and /classify (reward and label models).

Both run the model's classification head through the same `Pooling.Encode` call as embeddings; the worker
answers the head's raw logits. /classify hands them back as they are (SGLang's `embedding` field). /v1/rerank
tokenizes each (query, document) pair as one input with the tokenizer's pair template, so BERT-style models
get segment ids 1 on the document, and turns the single logit of a cross-encoder into a relevance score with
a sigmoid, as cross-encoders are trained; results come best first.
"""
from __future__ import annotations

import math

from aiohttp import web

from pdserve.services.gateway.apis.context import GATEWAY, new_id
from pdserve.services.gateway.apis.pooling.embeddings import TRUNCATE_HINT, answer_native, truncation
from pdserve.services.gateway.apis.served_models import CLASSIFY, MODELS
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.protocol import RequestModel, parse
from pdserve.services.gateway.workers.encoding import encode


class RerankRequest(RequestModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None  # cut each pair to k tokens (the longer text loses first)


async def rerank(request: web.Request) -> web.Response:
    body = await read_json(request)
    request.app[GATEWAY].limits.count(body.get("documents"), "max_list_items", "documents")
    req = parse(RerankRequest, body)
    served = await request.app[MODELS].require(req.model, CLASSIFY, "/v1/rerank")
    if served.num_labels != 1:
        raise ApiError(400, f"The model {served.name!r} has {served.num_labels} labels: /v1/rerank needs a "
                            "cross-encoder with one relevance output. Use /classify for its label scores.", "model")
    if not req.query:
        raise ApiError(400, "'query' is empty.", "query")
    if not req.documents:
        raise ApiError(400, "'documents' must hold at least one document.", "documents")
    if req.top_n is not None and req.top_n < 1:
        raise ApiError(400, f"'top_n' must be at least 1, got {req.top_n}.", "top_n")
    gw = served.gateway
    limit = gw.backend.context_length()
    keep = truncation(req.truncate_prompt_tokens, limit)
    gw.inputs.check_text_size(req.query, "query")
    for k, doc in enumerate(req.documents):
        if not doc:
            raise ApiError(400, f"Document {k} is empty.", f"documents.{k}")
        if keep is None:  # truncated pairs may be longer: the total below still bounds them
            gw.inputs.check_chars(len(req.query) + len(doc), f"documents.{k}", TRUNCATE_HINT)
    chars = len(req.query) * len(req.documents) + sum(map(len, req.documents))
    gw.limits.chars_total(chars, "documents", gw.tokenizer.max_token_chars)
    seqs, types = await gw.cpu.run(chars, _pairs, gw, req, keep, limit)
    if keep is None:
        gw.limits.tokens_total(seqs, "documents")
    result = await encode(gw.backend, new_id(), seqs, type_ids=types if any(any(t) for t in types) else None)
    ranked = sorted(((_sigmoid(out[0]), k) for k, out in enumerate(result.outputs)), key=lambda r: (-r[0], r[1]))
    answer = []
    for score, k in ranked[:req.top_n]:
        item = {"score": score, "index": k}
        if req.return_documents:
            item["document"] = req.documents[k]
        answer.append(item)
    return web.json_response(answer)


def _pairs(gw, req: RerankRequest, keep: int | None, limit: int) -> tuple[list[list[int]], list[list[int]]]:
    """(token ids, segment ids) of each (query, document) pair, by the tokenizer's pair template."""
    seqs, types = [], []
    for k, doc in enumerate(req.documents):
        pair = gw.tokenizer.tok(req.query, doc, truncation=keep is not None, max_length=keep)
        ids = list(pair["input_ids"])
        if len(ids) > limit:
            raise ApiError(400, f"The query with document {k} has {len(ids)} tokens, more than the model's context "
                                f"length of {limit} tokens; set 'truncate_prompt_tokens' to cut it.",
                           f"documents.{k}")
        seqs.append(ids)
        types.append(list(pair.get("token_type_ids") or []))
    return seqs, types


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


async def classify(request: web.Request) -> web.Response:
    return await answer_native(request, CLASSIFY, "/classify")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/classify", classify)
