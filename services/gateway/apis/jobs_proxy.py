"""/v1/files* and /v1/batches*: forwarded as they are to the jobs service (`--jobs-url`).

Bodies stream through in both directions (file uploads and downloads may be large), each bounded like the
gateway's own: an upload that sends nothing for --body-timeout is a 408, a download the client does not read
for --stream-write-timeout is cut off. The client's Authorization header goes along, so the jobs service sees
the same API key. Its answers, errors included,
come back unchanged. The path goes exactly as the client encoded it: decoded and parsed again, an id such as
`..%2F..%2Fhealth` would become a different path on the jobs service instead of an id it refuses (400).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from opentelemetry.trace import get_current_span as current_span
from yarl import URL

from pdserve.services import tracing
from pdserve.services.gateway.apis.context import GATEWAY, JOBS_SESSION
from pdserve.services.gateway.errors import ApiError

FORWARDED_REQUEST_HEADERS = ("Authorization", "Content-Type", "Accept", "OpenAI-Beta", "Idempotency-Key")
FORWARDED_REPLY_HEADERS = ("Content-Type", "Content-Disposition")


async def forward(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    if not gw.jobs_url:
        raise ApiError(404, "Files and Batches need the jobs service: start the gateway with --jobs-url.")
    session = request.app[JOBS_SESSION]
    url = URL(gw.jobs_url.rstrip("/") + request.rel_url.raw_path_qs, encoded=True)
    headers = {h: request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in request.headers}
    trace = tracing.traceparent_of(current_span())
    if trace:  # a batch remembers the request that made it: its items' traces link to it
        headers["traceparent"] = trace
    stalled = asyncio.Event()
    data = _upload(request, gw.limits.body_timeout_s, stalled) if request.body_exists else None
    reply: web.StreamResponse | None = None
    try:
        async with session.request(request.method, url, headers=headers, data=data) as upstream:
            reply = web.StreamResponse(status=upstream.status, headers={
                h: upstream.headers[h] for h in FORWARDED_REPLY_HEADERS if h in upstream.headers})
            if upstream.content_length is not None:
                reply.content_length = upstream.content_length
            await reply.prepare(request)
            async for chunk in upstream.content.iter_chunked(1 << 16):
                await _bounded(request, reply.write(chunk))
            await _bounded(request, reply.write_eof())
            return reply
    except (aiohttp.ClientError, TimeoutError) as exc:
        if stalled.is_set():
            response = ApiError(408, f"The upload sent nothing for {gw.limits.body_timeout_s:g} s "
                                     "(--body-timeout).").response()
            response.force_close()
            return response
        if reply is not None and reply.prepared:  # too late for an error status: cut the reply short
            raise ConnectionResetError(f"the jobs service failed mid-reply: {exc}") from None
        raise ApiError(503, f"The jobs service at {gw.jobs_url} is unreachable: {exc}") from None


async def _upload(request: web.Request, idle_s: float, stalled: asyncio.Event) -> AsyncIterator[bytes]:
    """The client's body as it arrives; ends the upload (`stalled`) when nothing comes for `idle_s`."""
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), idle_s)
        except TimeoutError:
            stalled.set()
            raise
        if not chunk:
            return
        yield chunk


async def _bounded(request: web.Request, write) -> None:
    """A write to a client that must take it within --stream-write-timeout, or lose the connection."""
    timeout_s = request.app[GATEWAY].limits.stream_write_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            await write
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"the client read nothing for {timeout_s:g} s") from None


async def open_session(app: web.Application):
    app[JOBS_SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10,
                                                                            sock_read=600))
    yield
    await app[JOBS_SESSION].close()


def add_routes(app: web.Application) -> None:
    for prefix in ("/v1/files", "/v1/batches"):
        app.router.add_route("*", prefix, forward)
        app.router.add_route("*", prefix + "/{tail:.*}", forward)
    app.cleanup_ctx.append(open_session)
