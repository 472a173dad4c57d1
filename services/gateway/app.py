"""The gateway's aiohttp application: routes, middlewares, and the worker pool's lifecycle.

Middlewares, outermost first: observation (the request id, which the response carries in X-Request-Id;
then, with every final status, the request count and the access line), error mapping (every exception
becomes an OpenAI-shaped error), body size limit and coding (body_encoding.py), API key check, the body read (within --body-timeout), and with
--log-requests the body log. A request head must arrive within --header-timeout (aiohttp's keep-alive timer).
The worker pool starts with the app and stops with it. Handlers are cancelled when their client
disconnects (see `run`), which cancels the gRPC calls they hold and so aborts the requests on the workers.
After observation, the drain check answers 503 once the gateway is stopping (see `Drain`). Between the two, the
Messages routes have their errors rewritten in Anthropic's shape (`messages_routes.anthropic_errors`).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode, use_span

from pdserve.services import tracing
from pdserve.services.gateway.apis import jobs_proxy, native, openai_routes, openapi, status_page
from pdserve.services.gateway.apis.admin import experts, lora, migrate, weights, workers
from pdserve.services.gateway.apis.context import ADMIN_CALLER, GATEWAY, Gateway
from pdserve.services.gateway.apis.messages import routes as messages_routes
from pdserve.services.gateway.apis.pooling import classify, embeddings
from pdserve.services.gateway.apis.responses import routes as responses_routes
from pdserve.services.gateway.apis.responses.store import ResponseStore
from pdserve.services.gateway import body_encoding
from pdserve.services.gateway.cpu_pool import CPU_POOL
from pdserve.services.gateway.errors import ApiError, Busy, answer, body_bytes, error_middleware, too_large
from pdserve.services.gateway.siblings import SIBLINGS, Siblings
from pdserve.shared.logs import HEADER, REQUEST_ID, request_id

log = logging.getLogger("pdserve.gateway")
# No API key: orchestrators probe, Prometheus scrapes (as SGLang, vLLM); the status page's HTML holds no data.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics", *status_page.PAGE_PATHS})
# What changes the deployment for everyone (its weights, adapters, cache, other clients' requests, recording):
# these need the admin key, never the inference key (SGLang's --admin-api-key).
ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/load_lora_adapter", "/unload_lora_adapter", "/flush_cache",
                         "/abort_request", "/start_expert_distribution_record", "/stop_expert_distribution_record",
                         "/dump_expert_distribution_record", *workers.PATHS, *migrate.PATHS})
# Other clients' requests, by id: their timings and token counts. With an API key and an admin key both set, the
# admin key's (so is /status.json's list of requests: status_page.py).
OTHER_CLIENTS_PREFIX = "/debug/requests/"
# Where an operator finds the admin key, for the 401 of an admin route (no value of it, only its places): `pdserve
# up` (services/up_plan.admin_key_path), compose.yaml, the Helm chart (tests/security/test_admin_key.py checks them).
ADMIN_KEY_WHERE = ("The admin key is the gateway's PDSERVE_ADMIN_API_KEY or --admin-api-key-file: `pdserve up` writes "
                   "it to <state dir>/admin-api-key (~/.local/state/pdserve/admin-api-key by default), Docker Compose "
                   "to /run/pdserve-secrets/admin-api-key in the gateway container, and the Helm chart keeps it in the "
                   "Secret <release>-pdserve-admin-api-key (or the one adminApiKey.existingSecret names).")
access_log = logging.getLogger("pdserve.access")
body_log = logging.getLogger("pdserve.requests")
# Asked every few seconds: their access lines are at debug level.
PROBE_PATHS = frozenset({"/health", "/live", "/metrics"})
MAX_LOGGED_BODY = 16 << 10  # characters of a request body --log-requests writes
REQUEST_ID_KEY = web.RequestKey("request_id", str)


def _route_name(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def observe(request: web.Request, handler):
    """Serves the request under its id (the client's X-Request-Id when it is a safe short token, else a new
    one), so that every line logged for it carries the id; then, with the final status it got, counts it in
    the metrics and logs method, path, status and duration (the access line)."""
    rid = request[REQUEST_ID_KEY] = request_id(request.headers.get(HEADER))
    token = REQUEST_ID.set(rid)
    start = time.perf_counter()
    status = 500
    span = request_span(request, rid) if tracing.enabled() and request.path not in PROBE_PATHS else None
    try:
        if span is None:
            response = await handler(request)
        else:
            with use_span(span, end_on_exit=False):
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
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
        request.app[GATEWAY].backend.metrics.requests.labels(_route_name(request), str(status)).inc()
        ms = (time.perf_counter() - start) * 1000
        access_log.log(logging.DEBUG if request.path in PROBE_PATHS else logging.INFO, "%s %s %d %.1f ms",
                       request.method, request.path, status, ms,
                       extra={"method": request.method, "path": request.path, "status": status,
                              "duration_ms": round(ms, 1), "client": request.remote})
        REQUEST_ID.reset(token)


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """X-Request-Id on every response, streamed ones included (their headers leave with the first event); and
    with tracing on, the request's trace as a `traceresponse` header (W3C Trace Context's response header)."""
    if REQUEST_ID_KEY in request:
        response.headers[HEADER] = request[REQUEST_ID_KEY]
    if SPAN_KEY in request:
        parent = tracing.traceparent_of(request[SPAN_KEY])
        if parent:
            response.headers["traceresponse"] = parent


SPAN_KEY = "pdserve.span"


def request_span(request: web.Request, rid: str):
    """The server span of one HTTP request: a child of the client's `traceparent` when it sent a valid one,
    else the root of a new trace (a malformed header is ignored, never an error); sampled as tracing.client_context
    decides."""
    parent = tracing.client_context(request.headers.get("traceparent"), request.headers.get("tracestate"))
    gateway = request.app[GATEWAY]
    span = tracing.tracer().start_span(
        f"{request.method} {_route_name(request)}", context=parent, kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.path, "pdserve.request_id": rid,
                    "gen_ai.request.model": gateway.served_model_name})
    request[SPAN_KEY] = span
    return span


@web.middleware
async def log_body(request: web.Request, handler):
    """--log-requests: the body of each authorised request at debug level; never a header (the API key is
    one). Uploads that the jobs proxy streams through are not read."""
    if request.body_exists and request.match_info.handler is not jobs_proxy.forward:
        body = (await body_bytes(request)).decode("utf-8", "replace")
        cut = f"... ({len(body)} characters)" if len(body) > MAX_LOGGED_BODY else ""
        body_log.debug("%s %s body: %s%s", request.method, request.path, body[:MAX_LOGGED_BODY], cut)
    return await handler(request)


@web.middleware
async def limit_body(request: web.Request, handler):
    """413 for a body whose Content-Length is over the limit, before anything reads it (a body without one is
    cut off at the same limit by aiohttp as it is read); 415 for a compressed body the gateway does not take
    (body_encoding.check). The jobs proxy streams uploads through: the jobs service holds them to its own limit."""
    limit = request.client_max_size
    streamed = request.match_info.handler is jobs_proxy.forward
    if (request.content_length or 0) > limit and not streamed:
        raise too_large(limit)
    body_encoding.check(request, request.app[GATEWAY].inflate_bodies, streamed)
    return await handler(request)


@web.middleware
async def read_body(request: web.Request, handler):
    """An authorised request's body, read here once within --body-timeout (408 after: a client cannot hold a
    connection and its handler by sending a body slowly), and inflated if it came compressed; handlers get it
    from aiohttp's cache (errors.body_bytes). Uploads that the jobs proxy streams through are not read."""
    if request.body_exists and request.match_info.handler is not jobs_proxy.forward:
        limits = request.app[GATEWAY].limits
        timeout_s = limits.body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                if body_encoding.content_encoding(request):
                    await body_encoding.inflate(request, limits, request.app[CPU_POOL])
                else:
                    await request.read()
        except TimeoutError:
            response = answer(request, ApiError(408, f"The request body did not arrive within {timeout_s:g} s "
                                                     "(--body-timeout)."))
            response.force_close()
            return response
    return await handler(request)


def presented_key(request: web.Request) -> bytes | None:
    """The key a request carries ('Authorization: Bearer KEY', or Anthropic's 'x-api-key: KEY'), as sent."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if "x-api-key" in request.headers:  # Anthropic's clients send the key there
        scheme, given = "bearer", request.headers["x-api-key"]
    if scheme.lower() != "bearer":
        return None
    # surrogateescape: header bytes that are not UTF-8 reach us as lone surrogates; compare them as sent.
    return given.strip().encode("utf-8", "surrogateescape")


def _is(given: bytes | None, key: str | None) -> bool:
    return bool(key) and given is not None and hmac.compare_digest(given, key.encode())


@web.middleware
async def check_api_key(request: web.Request, handler):
    gw = request.app[GATEWAY]
    if request.path in OPEN_PATHS:
        return await handler(request)
    given = presented_key(request)
    request[ADMIN_CALLER] = _is(given, gw.admin_api_key)
    if request.path.startswith(OTHER_CLIENTS_PREFIX) and gw.api_key and gw.admin_api_key \
            and not request[ADMIN_CALLER]:
        raise ApiError(401, "Other clients' requests are shown to the admin key only: send 'Authorization: Bearer "
                            f"<admin key>'. {ADMIN_KEY_WHERE}")
    if request.path in ADMIN_PATHS and not gw.open_admin_routes:
        if not gw.admin_api_key:
            raise ApiError(403, "Admin routes are off on this gateway: start it with an admin key "
                                "(PDSERVE_ADMIN_API_KEY or --admin-api-key-file), or with --open-admin-routes to let "
                                "them take the API key as before.")
        if not _is(given, gw.admin_api_key):
            raise ApiError(401, "This is an admin route: send 'Authorization: Bearer <admin key>' (the API key is "
                                f"not enough). {ADMIN_KEY_WHERE}")
        return await handler(request)
    if gw.api_key and not (_is(given, gw.api_key) or _is(given, gw.admin_api_key)):
        raise ApiError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' "
                            "(or 'x-api-key: <key>').")
    return await handler(request)


class Drain:
    """Requests in progress, and whether the gateway still takes new ones.

    Lifecycle on SIGTERM (`serve`): closing -> every new request, /health included, is answered 503 with
    Retry-After while those in progress go on -> all done, or the drain timeout passed and the generations
    still running were ended with an error -> the server closes.
    """

    def __init__(self) -> None:
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


DRAIN = web.AppKey("drain", Drain)
END_GRACE_S = 0.5  # after ending what is left: for handlers to write their error event, then to be cancelled


@web.middleware
async def drain_requests(request: web.Request, handler):
    drain = request.app[DRAIN]
    if drain.closing and request.path != "/live":  # alive while draining: a liveness failure would kill it
        response = answer(request, Busy(503, "The gateway is shutting down: send the request again (another "
                                             "instance will take it).", 1))
        response.force_close()
        return response
    drain.active += 1
    drain.idle.clear()
    try:
        return await handler(request)
    finally:
        drain.active -= 1
        if drain.active == 0:
            drain.idle.set()


def create_app(gateway: Gateway, extra_models: list[Gateway] = (),
               responses: ResponseStore | None = None, siblings: Siblings | None = None) -> web.Application:
    """`extra_models`: pooling models served beside `gateway`'s own (--embedding-model); `responses`: where
    /v1/responses keeps stored responses (default: this process's memory); `siblings`: the other processes of
    this gateway (--gateway-workers), which the admin routes that act everywhere reach."""
    middlewares = [observe, messages_routes.anthropic_errors, drain_requests, error_middleware, limit_body,
                   check_api_key, read_body]
    if gateway.server_args.get("log_requests"):
        middlewares.append(log_body)
    app = web.Application(middlewares=middlewares, client_max_size=gateway.limits.max_body_bytes)
    app.on_response_prepare.append(send_request_id)
    app[GATEWAY] = gateway
    app[CPU_POOL] = gateway.cpu
    app[DRAIN] = Drain()
    if siblings is not None:
        app[SIBLINGS] = siblings  # before the routes: they register what the siblings may ask
    openai_routes.add_routes(app)
    responses_routes.add_routes(app, responses)
    messages_routes.add_routes(app)
    native.add_routes(app)
    lora.add_routes(app)
    experts.add_routes(app)
    weights.add_routes(app)
    workers.add_routes(app)
    migrate.add_routes(app)
    embeddings.add_routes(app, list(extra_models))
    classify.add_routes(app)
    jobs_proxy.add_routes(app)
    status_page.add_routes(app)
    openapi.add_routes(app, OPEN_PATHS)

    async def pool_lifecycle(app: web.Application):
        await gateway.backend.start()
        if siblings is not None:
            await siblings.start()
        yield
        if siblings is not None:
            await siblings.close()
        await gateway.backend.close()
        gateway.cpu.close()
        gateway.close()

    app.cleanup_ctx.append(pool_lifecycle)
    if gateway.planner is not None:  # after the pool: it reads the workers' health
        app.cleanup_ctx.append(gateway.planner.lifecycle)
    return app


async def serve(app: web.Application, host: str, port: int, stop, drain_timeout_s: float = 30.0,
                reuse_port: bool = False, name: str = "gateway") -> None:
    """Serve until `stop` (an asyncio.Event) is set, then drain for up to `drain_timeout_s` and close.
    `reuse_port`: other processes of this gateway listen on the same port (SO_REUSEPORT); `name`: the process,
    in the start log."""
    # handler_cancellation: a client that disconnects cancels its handler, and with it the worker request.
    # keepalive_timeout: a connection that has not sent a whole request head within it (a new one, or one idle
    # after its last answer) is closed; aiohttp's default holds a half-sent request for an hour. lingering_time:
    # how long the rest of a body answered early (413, 408) is read before the connection closes.
    # auto_decompress off: a compressed body reaches the gateway as sent (body_encoding.py).
    header_timeout_s = app[GATEWAY].limits.header_timeout_s
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=END_GRACE_S,
                           keepalive_timeout=header_timeout_s, lingering_time=min(10.0, header_timeout_s),
                           auto_decompress=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port).start()
        log.info("%s listening on http://%s:%d", name, host, port)
        await stop.wait()
        await drain(app, drain_timeout_s)
    finally:
        await runner.cleanup()


async def drain(app: web.Application, timeout_s: float) -> None:
    """Refuse new requests and let those in progress finish; past `timeout_s`, end the generations left."""
    state = app[DRAIN]
    state.closing = True
    if state.active:
        log.info("stopping: %d request(s) in progress may finish within %g s", state.active, timeout_s)
    if await state.wait_idle(timeout_s):
        return
    ended = app[GATEWAY].backend.end_all(f"the gateway stopped after its drain timeout ({timeout_s:g} s)")
    log.warning("drain timeout: %d request(s) still in progress, %d generation(s) ended with an error",
                state.active, ended)
    await state.wait_idle(END_GRACE_S)
