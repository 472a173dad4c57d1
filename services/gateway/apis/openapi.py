"""GET /openapi.json: an OpenAPI 3.1 description of the gateway, generated from its router and request models.

Paths and methods come from the app's routes, so a new route is listed by itself. The body of a POST route
is the JSON schema of the pydantic model its handler parses (`BODIES`), so the document cannot drift from
what the gateway accepts. Routes forwarded to the jobs service (/v1/files, /v1/batches: any method) are left
to that service.
"""
from __future__ import annotations

import re

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdserve.services.gateway.apis.admin.lora import LoadLoraRequest, UnloadLoraRequest
from pdserve.services.gateway.apis.pooling.classify import RerankRequest
from pdserve.services.gateway.apis.context import GATEWAY
from pdserve.services.gateway.apis.messages.protocol import CountTokensRequest, MessagesRequest
from pdserve.services.gateway.apis.native import VERSION
from pdserve.services.gateway.apis.pooling.embeddings import EmbeddingRequest, NativeEncodeRequest, ScoreRequest
from pdserve.services.gateway.apis.responses.items import ResponsesRequest
from pdserve.services.gateway.intake.protocol import (AbortRequestBody, ChatCompletionRequest, CompletionRequest,
                                                      DetokenizeRequest, GenerateRequest, TokenizeRequest)

# The request model each POST route validates its JSON body with.
BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
    "/generate": GenerateRequest,
    "/encode": NativeEncodeRequest,
    "/classify": NativeEncodeRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/tokenize": TokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
    "/abort_request": AbortRequestBody,
    "/load_lora_adapter": LoadLoraRequest,
    "/unload_lora_adapter": UnloadLoraRequest,
}
METHODS = ("get", "post", "put", "patch", "delete")  # HEAD mirrors GET; "*" is the jobs proxy
RESPONSES = {"200": {"description": "Success"},
             "default": {"description": "An error: {object: 'error', message, type, param, code}"}}


def document(app: web.Application, open_paths: frozenset[str]) -> dict:
    """The document for `app`; `open_paths` are answered without the API key."""
    refs, defs = models_json_schema([(m, "validation") for m in dict.fromkeys(BODIES.values())],
                                    ref_template="#/components/schemas/{model}")
    paths: dict[str, dict] = {}
    for route in app.router.routes():
        method = route.method.lower()
        if method not in METHODS:
            continue
        path = route.resource.canonical
        name = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")
        operation: dict = {"operationId": f"{method}_{name}", "responses": RESPONSES}
        names = re.findall(r"{(\w+)}", path)
        if names:
            operation["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for n in names]
        model = BODIES.get(path) if method == "post" else None
        if model is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(model, "validation")]}}}
        if path in open_paths:
            operation["security"] = []
        paths.setdefault(path, {})[method] = operation
    doc = {"openapi": "3.1.0", "info": {"title": "pdserve gateway", "version": VERSION}, "paths": paths,
           "components": {"schemas": defs.get("$defs", {})}}
    if app[GATEWAY].api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def add_routes(app: web.Application, open_paths: frozenset[str]) -> None:
    async def openapi_json(request: web.Request) -> web.Response:
        return web.json_response(document(request.app, open_paths))

    app.router.add_get("/openapi.json", openapi_json)
