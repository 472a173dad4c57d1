"""`POST /workers/migrate`: move running generations live, with their KV, from one decode worker to another
(workers/live_move.py). The body names the source (`url`, as GET /workers lists it) and either `count` (that many
of its generations, the latest started first) or `rid` (one generation, by the id its client gave or was answered
under), and optionally the destination (`to`; else the router picks by free pages and load). The answer lists the
generations frozen for the move (their workers' ids) and those refused with the reason (they go on where they are).
An admin route (app.ADMIN_PATHS).
"""
from __future__ import annotations

from aiohttp import web
from pydantic import Field

from pdserve.services.gateway.apis.served_models import MODELS
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.protocol import RequestModel, parse
from pdserve.services.gateway.workers.live_move import MoveRefused

PATHS = frozenset({"/workers/migrate"})


class MigrateRequest(RequestModel):
    url: str = Field(min_length=1, max_length=300)
    count: int | None = Field(default=None, ge=1, le=100_000)
    rid: str | None = Field(default=None, min_length=1, max_length=400)
    to: str | None = Field(default=None, min_length=1, max_length=300)


def _address(url: str) -> str:
    return url.removeprefix("grpc://").removeprefix("http://")


async def migrate(request: web.Request) -> web.Response:
    req = parse(MigrateRequest, await read_json(request))
    if (req.count is None) == (req.rid is None):
        raise ApiError(400, "Name either 'count' (how many of the worker's generations move) or 'rid' (which one).",
                       "count")
    url, to = _address(req.url), _address(req.to) if req.to else None
    for model in request.app[MODELS].models:
        backend = model.gateway.backend
        worker = backend.pool.workers.get(url)
        if worker is None:
            continue
        gen = backend.generations.get(req.rid) if req.rid else None
        rids = [gen.worker_rid if gen is not None else req.rid] if req.rid else []
        try:
            reply = await backend.mover.rebalance(worker, rids, req.count or 0, to)
        except MoveRefused as exc:
            raise ApiError(exc.status, str(exc), exc.param) from None
        return web.json_response({"success": bool(reply.frozen), "url": url, "frozen": list(reply.frozen),
                                  "refused": list(reply.refused)})
    raise ApiError(404, f"No worker at {url!r}; GET /workers lists them.", "url")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/workers/migrate", migrate)
