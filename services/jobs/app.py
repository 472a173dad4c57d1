"""HTTP routes of the jobs service: OpenAI Files and Batches over the Redis store, plus /health.

Handlers parse and validate, call one store transition and render the result; they keep no state of their
own. Authentication and the mapping of every error to an HTTP status happen here, in one middleware.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass

from aiohttp import web
from redis.exceptions import RedisError

from pdserve.services import tracing
from pdserve.services.jobs import batches, files
from pdserve.services.jobs.errors import ApiError, bad_request, conflict, invalid_id, not_found
from pdserve.services.jobs.metrics import JobsMetrics
from pdserve.services.jobs.store import (BATCH_ID, FILE_ID, QuotaExceeded, Store, TooManyFiles, dump, is_id, new_id,
                                         now)

log = logging.getLogger("pdserve.jobs")


@dataclass(frozen=True)
class Settings:
    api_key: str | None
    max_file_size: int
    completion_window_s: int | None = None  # overrides every window's length (for tests of expiry)
    files_quota: int = 0  # bytes all files together may take in Redis (0: no limit)
    min_expiry_s: int = files.MIN_EXPIRY_S  # the least `expires_after[seconds]` (lowered by tests of expiry)
    max_unfinished_batches: int = 0  # batches not yet ended at once (0: no limit)
    body_idle_s: float = files.BODY_IDLE_S  # an upload that sends nothing this long is a 408
    max_files: int = 0  # files stored at once, uploads and batch outputs (0: no limit; outputs never refused)


STORE = web.AppKey("store", Store)
SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", JobsMetrics)
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers hold no API key; neither route shows user data


def error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


@web.middleware
async def errors_and_auth(request: web.Request, handler) -> web.StreamResponse:
    settings: Settings = request.app[SETTINGS]
    try:
        if settings.api_key and request.path not in OPEN_PATHS:
            # surrogateescape: header bytes that are not UTF-8 reach us as lone surrogates; compare them as sent.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {settings.api_key}".encode()):
                raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status == 413:
            return error_response(ApiError(413, "The request body is too large.", code="request_too_large"))
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, exc.reason, code=None))
    except RedisError as exc:
        log.warning("storage unavailable for %s %s: %s", request.method, request.path, exc)
        return error_response(ApiError(503, "Storage is unavailable; retry shortly.", type="server_error",
                                       code="storage_unavailable"))
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "Internal server error.", type="server_error"))


def query_limit(request: web.Request, default: int, maximum: int) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    try:
        limit = int(raw)
    except ValueError:
        raise bad_request(f"'limit' must be an integer, not {raw!r}.", "limit") from None
    if not 1 <= limit <= maximum:
        raise bad_request(f"'limit' must be between 1 and {maximum}.", "limit")
    return limit


def client_id(value: str | None, what: str, prefix: str, param: str) -> str | None:
    """An id from a path or query, checked to be one this service could have issued (None stays None)."""
    if value is not None and not is_id(value, prefix):
        raise invalid_id(what, value, prefix, param)
    return value


def path_file_id(request: web.Request) -> str:
    return client_id(request.match_info["file_id"], "file", FILE_ID, "file_id")


def path_batch_id(request: web.Request) -> str:
    return client_id(request.match_info["batch_id"], "batch", BATCH_ID, "batch_id")


def listing(data: list[dict], has_more: bool) -> web.Response:
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": has_more})


async def metrics(request: web.Request) -> web.Response:
    return await request.app[METRICS].render(request.app[STORE])


async def health(request: web.Request) -> web.Response:
    try:
        await request.app[STORE].ping()
    except RedisError:
        return web.Response(status=503, text="redis unavailable")
    return web.Response(text="ok")


# ---------------------------------------------------------------- files


async def create_file(request: web.Request) -> web.Response:
    settings: Settings = request.app[SETTINGS]
    writer = request.app[STORE].writer(new_id(FILE_ID), settings.files_quota)
    try:
        if settings.max_files and await request.app[STORE].r.zcard(request.app[STORE].k.files) >= settings.max_files:
            raise TooManyFiles(settings.max_files)  # clearly full: refused before the upload is read
        upload = await files.read_upload(request, settings.max_file_size, writer, settings.min_expiry_s,
                                         settings.body_idle_s)
        meta = await writer.commit(upload.filename, upload.purpose, upload.expires_after_s, settings.max_files)
    except BaseException as exc:  # refused, the client went away, Redis failed: nothing of it stays
        await asyncio.shield(writer.discard())
        if isinstance(exc, QuotaExceeded):
            log.warning("upload refused: files use %d of their %d-byte quota", exc.used, exc.quota)
            raise files.quota_full(exc) from None
        if isinstance(exc, TooManyFiles):
            raise files.too_many(exc.limit) from None
        raise
    return web.json_response(files.render(meta))


async def list_files(request: web.Request) -> web.Response:
    store: Store = request.app[STORE]
    limit = query_limit(request, 10_000, 10_000)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'.", "order")
    purpose = request.query.get("purpose")
    after = client_id(request.query.get("after"), "file", FILE_ID, "after")
    found: list[dict] = []
    while True:  # pages of ids, filtered by purpose, until `limit` objects or the end
        page = await store.page(store.k.files, after, limit, descending=order == "desc")
        metas = await store.get_files(page.ids)
        found += [m for m in metas if purpose is None or m["purpose"] == purpose]
        if len(found) > limit or not page.has_more:
            break
        after = page.ids[-1]
    more = len(found) > limit or page.has_more
    return listing([files.render(m) for m in found[:limit]], more)


async def get_file(request: web.Request) -> web.Response:
    file_id = path_file_id(request)
    meta = await request.app[STORE].get_file(file_id)
    if meta is None:
        raise not_found("file", file_id, "file_id")
    return web.json_response(files.render(meta))


async def file_content(request: web.Request) -> web.StreamResponse:
    """The content, streamed a chunk at a time from Redis to the client."""
    file_id = path_file_id(request)
    store: Store = request.app[STORE]
    meta = await store.get_file(file_id)
    if meta is None:
        raise not_found("file", file_id, "file_id")
    reply = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    reply.content_length = int(meta["bytes"])
    await reply.prepare(request)
    async for chunk in store.iter_content(file_id):
        await reply.write(chunk)
    await reply.write_eof()
    return reply


async def delete_file(request: web.Request) -> web.Response:
    file_id = path_file_id(request)
    outcome = await request.app[STORE].delete_file(file_id)
    if outcome in ("missing", "expired"):
        raise not_found("file", file_id, "file_id")
    if outcome.startswith("in_use:"):
        batch_id = outcome.split(":", 1)[1]
        raise conflict(f"File {file_id!r} is the input of batch {batch_id!r}, which has not finished; cancel it "
                       "or wait for it before deleting the file.", "file_id", "file_in_use")
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


# ---------------------------------------------------------------- batches


async def create_batch(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise bad_request("The request body is not valid JSON.") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    settings: Settings = request.app[SETTINGS]
    params = batches.parse_create(body, settings.min_expiry_s)
    created = now()
    window = settings.completion_window_s or batches.COMPLETION_WINDOWS[params.completion_window]
    batch_id = new_id(BATCH_ID)
    fields: dict[str, str | int] = {
        "id": batch_id, "status": "validating", "endpoint": params.endpoint, "input_file_id": params.input_file_id,
        "completion_window": params.completion_window, "created_at": created, "expires_at": created + window,
        "total": 0, "metadata": dump(params.metadata) if params.metadata is not None else "",
        "output_expires_after": params.output_expires_after_s or "",
        "trace": tracing.well_formed(request.headers.get("traceparent"))}
    store: Store = request.app[STORE]
    outcome = await store.create_batch(batch_id, params.input_file_id, fields, settings.max_unfinished_batches)
    if outcome == "busy":
        raise ApiError(429, f"{settings.max_unfinished_batches} batches are already validating, in progress or "
                            "finalizing, the most this server runs at once (--max-unfinished-batches): create this "
                            "one when one of them has ended.", None, "too_many_batches", type="rate_limit_error",
                       headers={"Retry-After": "60"})
    if outcome == "missing":
        raise not_found("file", params.input_file_id, "input_file_id")
    if outcome.startswith("purpose:"):
        raise bad_request(f"File {params.input_file_id!r} has purpose {outcome.split(':', 1)[1]!r}; a batch input "
                          "file must be uploaded with purpose 'batch'.", "input_file_id", "invalid_file_purpose")
    log.info("batch %s created from %s for %s", batch_id, params.input_file_id, params.endpoint)
    return web.json_response(batches.render(await store.get_batch(batch_id)))


async def get_batch(request: web.Request) -> web.Response:
    batch_id = path_batch_id(request)
    record = await request.app[STORE].get_batch(batch_id)
    if record is None:
        raise not_found("batch", batch_id, "batch_id")
    return web.json_response(batches.render(record))


async def list_batches(request: web.Request) -> web.Response:
    store: Store = request.app[STORE]
    after = client_id(request.query.get("after"), "batch", BATCH_ID, "after")
    page = await store.page(store.k.batches, after, query_limit(request, 20, 100))
    records = await store.get_batches(page.ids)
    return listing([batches.render(r) for r in records if r], page.has_more)


async def cancel_batch(request: web.Request) -> web.Response:
    batch_id = path_batch_id(request)
    store: Store = request.app[STORE]
    outcome = await store.cancel_batch(batch_id)
    if outcome == "missing":
        raise not_found("batch", batch_id, "batch_id")
    if outcome.startswith("conflict:"):
        raise conflict(f"Batch {batch_id!r} cannot be cancelled: its status is {outcome.split(':', 1)[1]}.",
                       "batch_id", "batch_not_cancellable")
    log.info("batch %s cancelling", batch_id)
    return web.json_response(batches.render(await store.get_batch(batch_id)))


def build_app(store: Store, settings: Settings) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=4 << 20)
    app[STORE] = store
    app[SETTINGS] = settings
    app[METRICS] = JobsMetrics(settings.files_quota)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    return app
