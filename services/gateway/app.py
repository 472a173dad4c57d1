"""The gateway's aiohttp application: routes, middlewares, and the worker pool's lifecycle.

Middlewares, outermost first: request counting (sees every final status), error mapping (every exception
becomes an OpenAI-shaped error), body size limit, API key check. The worker pool starts with the app and
stops with it. Handlers are cancelled when their client disconnects (see `run`), which cancels the gRPC
calls they hold and so aborts the requests on the workers.
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from pdserve.services.gateway import (expert_api, jobs_proxy, lora_api, native_api, openai_api, openapi, pooling_api,
                                      status_page, weights_api)
from pdserve.services.gateway.context import GATEWAY, Gateway
from pdserve.services.gateway.errors import ApiError, error_middleware, too_large

log = logging.getLogger("pdserve.gateway")
# No API key: orchestrators probe, Prometheus scrapes (as SGLang, vLLM); the status page's HTML holds no data.
OPEN_PATHS = frozenset({"/health", "/metrics", *status_page.PAGE_PATHS})


def _route_name(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def count_requests(request: web.Request, handler):
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionError):
        status = 499  # the client went away before the answer was complete
        raise
    finally:
        request.app[GATEWAY].backend.metrics.requests.labels(_route_name(request), str(status)).inc()


@web.middleware
async def limit_body(request: web.Request, handler):
    """413 for a body whose Content-Length is over the limit, before anything reads it (a body without one is
    cut off at the same limit by aiohttp as it is read). The jobs proxy streams uploads through: the jobs
    service holds them to its own limit."""
    limit = request.client_max_size
    if (request.content_length or 0) > limit and request.match_info.handler is not jobs_proxy.forward:
        raise too_large(limit)
    return await handler(request)


@web.middleware
async def check_api_key(request: web.Request, handler):
    key = request.app[GATEWAY].api_key
    if key and request.path not in OPEN_PATHS:
        auth = request.headers.get("Authorization", "")
        scheme, _, given = auth.partition(" ")
        # surrogateescape: header bytes that are not UTF-8 reach us as lone surrogates; compare them as sent.
        given_bytes = given.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, key.encode()):
            raise ApiError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.")
    return await handler(request)


def create_app(gateway: Gateway, extra_models: list[Gateway] = ()) -> web.Application:
    """`extra_models`: pooling models served beside `gateway`'s own (--embedding-model)."""
    app = web.Application(middlewares=[count_requests, error_middleware, limit_body, check_api_key],
                          client_max_size=gateway.max_body_bytes)
    app[GATEWAY] = gateway
    openai_api.add_routes(app)
    native_api.add_routes(app)
    lora_api.add_routes(app)
    expert_api.add_routes(app)
    weights_api.add_routes(app)
    pooling_api.add_routes(app, list(extra_models))
    jobs_proxy.add_routes(app)
    status_page.add_routes(app)
    openapi.add_routes(app, OPEN_PATHS)

    async def pool_lifecycle(app: web.Application):
        await gateway.backend.pool.start()
        yield
        await gateway.backend.pool.close()

    app.cleanup_ctx.append(pool_lifecycle)
    return app


async def serve(app: web.Application, host: str, port: int, stop) -> None:
    """Serve until `stop` (an asyncio.Event) is set."""
    # handler_cancellation: a client that disconnects cancels its handler, and with it the worker request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("gateway listening on http://%s:%d", host, port)
        await stop.wait()
    finally:
        await runner.cleanup()
