"""The models one gateway serves, what each can do, and how a request's `model` picks one.

The gateway's own model (--model-path) is the primary: requests that name no model, or "default", go to it.
A dedicated embedding deployment beside it (--embedding-model PATH, --embedding-worker HOST:PORT) adds a
second model with its own tokenizer and worker pool. Each model's kind comes from its config.json, so a
request for an endpoint the model cannot serve is a 400 naming the model and what it serves, answered here
before any worker is asked:
- generate: decoder models on the paged runtime (chat, completions, /generate, /v1/score);
- embed: encoder checkpoints pooled into one vector, and decoders served with --is-embedding (/v1/embeddings,
  /encode);
- classify: sequence-classification checkpoints, cross-encoders and reward models among them (/v1/rerank,
  /classify).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from aiohttp import web

from pdserve.services.gateway.apis.context import GATEWAY, Gateway
from pdserve.services.gateway.apis.openai_format import model_card
from pdserve.services.gateway.errors import ApiError, parse_body
from pdserve.services.gateway.workers.adapters import loaded_adapters, lora_enabled, refresh_adapters
from pdserve.shared.config import ENCODER_MODEL_TYPES

GENERATE, EMBED, CLASSIFY = "generate", "embed", "classify"
ENDPOINTS = {
    GENERATE: ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/score"),
    EMBED: ("/v1/embeddings", "/encode"),
    CLASSIFY: ("/v1/rerank", "/classify"),
}
KIND_NAMES = {GENERATE: "a generative model", EMBED: "an embedding model", CLASSIFY: "a classification model"}
# Routes of the generative APIs whose handlers live elsewhere: the kind check for them runs as a middleware.
GENERATIVE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})


@dataclass(frozen=True)
class ServedModel:
    gateway: Gateway  # its tokenizer, worker pool and names
    kind: str  # GENERATE, EMBED or CLASSIFY
    dimension: int | None = None  # embedding size (hidden size of an encoder)
    matryoshka: bool = False  # trained so that leading dimensions are an embedding too
    matryoshka_dims: tuple[int, ...] = ()
    num_labels: int = 0  # classifier outputs

    @property
    def name(self) -> str:
        return self.gateway.served_model_name

    def refuse(self, endpoint: str) -> ApiError:
        """The 400 for asking this model for `endpoint`, which a model of another kind serves."""
        needs = next(kind for kind, paths in ENDPOINTS.items() if endpoint in paths)
        how = {EMBED: " (a worker started with --is-embedding on an embedding model)",
               CLASSIFY: " (a sequence-classification or cross-encoder checkpoint)"}.get(needs, "")
        return ApiError(400, f"The model {self.name!r} is {KIND_NAMES[self.kind]}: {endpoint} needs "
                             f"{KIND_NAMES[needs]}{how}. It serves {', '.join(ENDPOINTS[self.kind])}.", "model")


def describe(gw: Gateway) -> ServedModel:
    """What the model behind `gw` is, read from its config.json."""
    config = _read_config(gw.model_path)
    model_type = gw.model_config.model_type or config.get("model_type")
    archs = gw.model_config.architectures or list(config.get("architectures") or [])
    classifier = any("ForSequenceClassification" in a for a in archs)
    bare = bool(archs) and not any(a.endswith(("ForCausalLM", "ForSequenceClassification")) for a in archs)
    if model_type not in ENCODER_MODEL_TYPES and not (classifier or bare or gw.is_embedding):
        return ServedModel(gw, GENERATE)
    if classifier:
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
        return ServedModel(gw, CLASSIFY, num_labels=labels)
    dims = tuple(config.get("matryoshka_dimensions") or ())
    return ServedModel(gw, EMBED, config.get("hidden_size"), bool(config.get("is_matryoshka") or dims), dims)


def _read_config(model_path: str) -> dict:
    from pdserve.shared.model_files import ModelNotFound, resolve_model_path

    try:
        return json.loads((resolve_model_path(model_path, quiet=True) / "config.json").read_text())
    except (ModelNotFound, OSError, ValueError):
        return {}


class ServedModels:
    """Every model of this gateway, the primary first."""

    def __init__(self, models: list[ServedModel]) -> None:
        self.models = models
        self.primary = models[0]

    async def pick(self, name: str | None, kind: str | None = None) -> ServedModel:
        """The model a request names. A name nothing serves is SGLang's: a 400 when --served-model-name was
        given, else the first model of `kind` (the primary when none is) serves the request."""
        if name is None:
            return self.primary
        for model in self.models:
            if name in model.gateway.accepted_model_names:
                return model
        if await self.primary.gateway.adapter_of(name) is not None:  # raises where names are strict
            return self.primary  # one of its LoRA adapters
        return next((m for m in self.models if m.kind == kind), self.primary)

    async def require(self, name: str | None, kind: str, endpoint: str) -> ServedModel:
        model = await self.pick(name, kind)
        if model.kind != kind:
            raise model.refuse(endpoint)
        return model

    async def cards(self) -> list[dict]:
        """/v1/models entries, the primary first, with the adapters its workers hold now."""
        backend = self.primary.gateway.backend
        if lora_enabled(backend.serving_workers()):
            await refresh_adapters(backend.serving_workers(), backend.settings.rpc_timeout_s)
        cards = [model_card(m.name, m.gateway.created, m.gateway.backend.context_length()) for m in self.models]
        return cards[:1] + adapter_cards(self.primary.gateway) + cards[1:]


MODELS: web.AppKey[ServedModels] = web.AppKey("served_models", ServedModels)


@web.middleware
async def refuse_wrong_kind(request: web.Request, handler):
    """Chat, completions and /generate for a model that does not generate: a 400 naming the model."""
    if request.method == "POST" and request.path in GENERATIVE_ROUTES:
        name = await _named_model(request)
        models = request.app[MODELS]
        model = models.primary if name is None else next(
            (m for m in models.models if name in m.gateway.accepted_model_names), None)
        if model is not None and model.kind != GENERATE:  # unknown names: the handler's own 404
            raise model.refuse(request.path)
    return await handler(request)


async def _named_model(request: web.Request) -> str | None:
    body = (await parse_body(request)).value  # decoded once: the handler gets the same (not JSON: None)
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


# ---------------------------------------------------------------- the dedicated embedding model
def build_embedding_gateway(args: argparse.Namespace, primary: Gateway) -> Gateway | None:
    """A Gateway for --embedding-model that shares the primary's settings and metrics, or None."""
    if not args.embedding_model:
        return None
    if not args.embedding_worker:
        raise ValueError("--embedding-model needs at least one --embedding-worker HOST:PORT")
    from pdserve.services.gateway.tokenization import ModelTokenizer, read_model_config
    from pdserve.services.gateway.workers.backend import Backend, BackendSettings
    from pdserve.services.gateway.workers.pool import HealthSettings, WorkerPool
    from pdserve.services.gateway.workers.router import Router
    from pdserve.shared.model_files import resolve_model_path

    model_dir = resolve_model_path(args.embedding_model, quiet=True)
    given = args.embedding_model
    served = args.embedding_served_model_name or given
    names = {served, given, str(model_dir), model_dir.name}
    if names & primary.accepted_model_names:
        raise ValueError(f"--embedding-model {given!r} shares a name with --model-path; pass "
                         "--embedding-served-model-name")
    tokenizer = ModelTokenizer(str(model_dir))
    config = read_model_config(model_dir)
    pool = WorkerPool({"colocated": args.embedding_worker, "prefill": [], "decode": []},
                      HealthSettings(interval_s=args.health_check_interval))
    backend = Backend(tokenizer, pool, Router(pool, args.routing_policy), primary.backend.metrics,
                      BackendSettings(max_queued_requests=args.max_queued_requests, processes=args.gateway_workers),
                      default_context_length=config.max_position_embeddings)
    return Gateway(backend=backend, tokenizer=tokenizer, served_model_name=served, model_path=given,
                   tokenizer_path=str(model_dir), model_config=config, api_key=primary.api_key,
                   accepted_model_names=frozenset(names), is_embedding=True, limits=primary.limits, cpu=primary.cpu)


def install(app: web.Application, extra: list[Gateway]) -> ServedModels:
    """Register the models on `app`, add the kind check, and run the extra models' worker pools with it."""
    models = ServedModels([describe(app[GATEWAY]), *(describe(gw) for gw in extra)])
    app[MODELS] = models
    app.middlewares.append(refuse_wrong_kind)

    async def pools(app: web.Application):
        for gw in extra:
            await gw.backend.start()
        yield
        for gw in extra:
            await gw.backend.close()

    if extra:
        app.cleanup_ctx.append(pools)
    return models


def adapter_cards(gw: Gateway) -> list[dict]:
    """/v1/models entries of the loaded adapters: each with its base model as `parent`."""
    cards = []
    for name, adapter in sorted(loaded_adapters(gw.backend.serving_workers()).items()):
        card = model_card(name, gw.created, gw.backend.context_length())
        cards.append({**card, "root": adapter.path, "parent": gw.served_model_name})
    return cards
