"""The workers' admin routes, in SGLang's model gateway's shape: `GET /workers` lists every worker (`url`,
`worker_type`: prefill, decode or regular, its health and load) and `POST /workers/switch_role`
{"url", "worker_type"} switches one worker's role live (workers/role_switch.py), answering once it serves in the
new role with the seconds it took, or a 4xx/503 naming the reason. Both need the admin key (app.ADMIN_PATHS).
"""
from __future__ import annotations

from aiohttp import web
from pydantic import Field

from pdserve.services.gateway.apis.served_models import GENERATE, MODELS
from pdserve.services.gateway.errors import read_json
from pdserve.services.gateway.intake.protocol import RequestModel, parse
from pdserve.services.gateway.workers.pool import Worker
from pdserve.services.gateway.workers.role_switch import SwitchRefused, switch_role, worker_type
from pdserve.services.gateway.workers.router import load_of

PATHS = frozenset({"/workers", "/workers/switch_role"})


class SwitchRoleRequest(RequestModel):
    url: str = Field(min_length=1, max_length=300)
    worker_type: str = Field(min_length=1, max_length=40)


def describe(worker: Worker, model: str) -> dict:
    return {"url": worker.address, "model_id": model, "worker_type": worker_type(worker.role),
            "is_healthy": worker.healthy, "switching": worker.switching, "load": load_of(worker),
            **{k: v for k, v in worker.describe().items() if k not in ("address", "role", "healthy")}}


async def list_workers(request: web.Request) -> web.Response:
    workers = [describe(w, m.name) for m in request.app[MODELS].models
               for w in m.gateway.backend.pool.workers.values()]
    return web.json_response({"workers": workers, "total": len(workers)})


async def switch_worker_role(request: web.Request) -> web.Response:
    req = parse(SwitchRoleRequest, await read_json(request))
    url = req.url.removeprefix("grpc://").removeprefix("http://")
    for model in request.app[MODELS].models:
        pool = model.gateway.backend.pool
        if url not in pool.workers:
            continue
        if model.kind != GENERATE or model.gateway.is_embedding:
            raise SwitchRefused(400, "embedding_worker", f"Worker {url} serves {model.name!r}, an embedding or "
                                                         "scoring model, which has no prefill or decode role.", "url")
        seconds = await switch_role(pool, url, req.worker_type)
        return web.json_response({"success": True, "url": url, "worker_type": worker_type(pool.workers[url].role),
                                  "seconds": round(seconds, 3)})
    raise SwitchRefused(404, "unknown_worker", f"No worker at {url!r}; GET /workers lists them.", "url")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers/switch_role", switch_worker_role)
