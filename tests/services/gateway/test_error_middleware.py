"""The error middleware alone: every exception becomes an OpenAI-shaped error, a 500 never shows internals."""
from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel

from pdserve.services.gateway.errors import ApiError, error_middleware


class Body(BaseModel):
    count: int


async def crash(request):
    raise RuntimeError("secret internal detail at /srv/app.py line 42")


async def refuse(request):
    raise ApiError(400, "bad value for 'x'", "x")


async def invalid(request):
    Body.model_validate({"count": "many"})


async def client() -> TestClient:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/crash", crash)
    app.router.add_get("/refuse", refuse)
    app.router.add_get("/invalid", invalid)
    c = TestClient(TestServer(app))
    await c.start_server()
    return c


async def test_unexpected_exception_is_500_without_traceback():
    c = await client()
    try:
        r = await c.get("/crash")
        body = await r.json()
        assert r.status == 500
        assert body == {"object": "error", "message": "Internal server error.", "type": "internal_server_error",
                        "param": None, "code": 500}
        text = str(body)
        assert "secret" not in text and "Traceback" not in text
    finally:
        await c.close()


async def test_api_errors_validation_errors_and_unknown_routes_share_one_shape():
    c = await client()
    try:
        r = await c.get("/refuse")
        assert r.status == 400 and (await r.json())["param"] == "x"
        r = await c.get("/invalid")
        body = await r.json()
        assert r.status == 400 and body["param"] == "count" and "count" in body["message"]
        r = await c.get("/nope")
        assert r.status == 404 and (await r.json())["type"] == "not_found_error"
        r = await c.post("/refuse")
        assert r.status == 405 and (await r.json())["object"] == "error"
    finally:
        await c.close()
