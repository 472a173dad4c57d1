"""/v1/files and /v1/batches go to the jobs service unchanged: method, path, query, key, body, status, headers."""
from __future__ import annotations

from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.services.gateway.apis import jobs_proxy
from pdserve.services.gateway.apis.context import GATEWAY
from pdserve.services.gateway.errors import error_middleware
from pdserve.services.gateway.limits import Limits


async def upstream_echo(request: web.Request) -> web.Response:
    body = await request.read()
    if request.path.endswith("/missing"):
        return web.json_response({"error": {"message": "No such file", "type": "invalid_request_error",
                                            "param": None, "code": "file_not_found"}}, status=404)
    return web.json_response({"method": request.method, "path_qs": request.rel_url.path_qs,
                              "auth": request.headers.get("Authorization"), "size": len(body),
                              "content_type": request.headers.get("Content-Type")},
                             headers={"Content-Disposition": 'attachment; filename="x.jsonl"'})


async def start(jobs_url: str | None) -> TestClient:
    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = SimpleNamespace(jobs_url=jobs_url, limits=Limits())
    jobs_proxy.add_routes(app)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_requests_and_replies_pass_through_unchanged():
    up_app = web.Application(client_max_size=16 << 20)
    up_app.router.add_route("*", "/{tail:.*}", upstream_echo)
    upstream = TestServer(up_app)
    await upstream.start_server()
    client = await start(str(upstream.make_url("")))
    try:
        blob = b"x" * (3 << 20)  # larger than one chunk: streamed through
        r = await client.post("/v1/files?purpose=batch", data=blob,
                              headers={"Authorization": "Bearer k", "Content-Type": "application/octet-stream"})
        got = await r.json()
        assert r.status == 200 and r.headers["Content-Disposition"] == 'attachment; filename="x.jsonl"'
        assert got == {"method": "POST", "path_qs": "/v1/files?purpose=batch", "auth": "Bearer k",
                       "size": len(blob), "content_type": "application/octet-stream"}
        r = await client.post("/v1/batches/batch_1/cancel")
        assert (await r.json())["path_qs"] == "/v1/batches/batch_1/cancel"
        r = await client.get("/v1/files/missing")
        assert r.status == 404 and (await r.json())["error"]["code"] == "file_not_found"
    finally:
        await client.close()
        await upstream.close()


async def test_without_jobs_service_the_routes_say_how_to_enable_them():
    client = await start(None)
    try:
        r = await client.get("/v1/batches")
        body = await r.json()
        assert r.status == 404 and "--jobs-url" in body["message"] and body["object"] == "error"
    finally:
        await client.close()


async def test_unreachable_jobs_service_is_503():
    client = await start("http://127.0.0.1:1")
    try:
        r = await client.get("/v1/files")
        assert r.status == 503 and "unreachable" in (await r.json())["message"]
    finally:
        await client.close()
