"""SGLang's endpoints that load and unload LoRA adapters while serving (their /v1/models cards: served_models.py).

POST /load_lora_adapter {"lora_name", "lora_path"} loads on every worker or, if any refuses, unloads it from
the others again: nothing stays loaded half-way. POST /unload_lora_adapter {"lora_name"} is refused while
requests use the adapter. Both first read what the workers hold now: another gateway process or replica may
have changed it.
"""
from __future__ import annotations

from aiohttp import web
from pydantic import Field

from pdserve.services.gateway.apis.context import GATEWAY, Gateway
from pdserve.services.gateway.errors import ApiError, read_json
from pdserve.services.gateway.intake.protocol import RequestModel, parse
from pdserve.services.gateway.workers.adapters import loaded_adapters, refresh_adapters
from pdserve.services.gateway.workers.admin import load_adapter, unload_adapter
from pdserve.services.gateway.workers.pool import Worker

RPC_TIMEOUT_S = 60.0  # an adapter load reads and checks its files on the worker's engine thread


class LoadLoraRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False  # SGLang's: keep it in a slot; accepted, every adapter stays loaded until unloaded here


class UnloadLoraRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=200)


# ---------------------------------------------------------------- load / unload
async def load_lora_adapter(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse(LoadLoraRequest, await read_json(request))
    if req.lora_name in gw.accepted_model_names:
        raise ApiError(400, f"'lora_name' {req.lora_name!r} is the base model's name.", "lora_name")
    workers = await _reachable(gw)
    before = {w.address: _had(w, req.lora_name) for w in workers}
    answers = await load_adapter(workers, req.lora_name, req.lora_path)
    errors = [error for error in answers if error]
    if errors:
        # Nothing half-way: take it back from the workers that took it (an adapter they had before stays).
        await unload_adapter([w for w, error in zip(workers, answers) if not error and not before[w.address]],
                             req.lora_name)
        return _failure(errors[0], "lora_path")
    return _success(gw)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse(UnloadLoraRequest, await read_json(request))
    workers = await _reachable(gw)
    if req.lora_name not in {a.name for w in workers for a in w.info.lora_adapters}:
        raise ApiError(400, f"LoRA adapter {req.lora_name!r} is not loaded.", "lora_name")
    errors = [error for error in await unload_adapter(workers, req.lora_name) if error]
    return _failure(errors[0], "lora_name") if errors else _success(gw)


async def _reachable(gw: Gateway) -> list[Worker]:
    workers = gw.backend.serving_workers()
    down = [w.address for w in workers if not w.healthy or w.info is None]
    if not workers or down:
        raise ApiError(503, f"Workers {', '.join(down) or '(none)'} are not serving; adapters change on every "
                            "worker at once, so try again when all are healthy.", None)
    if not all(w.info.lora_enabled for w in workers):
        raise ApiError(400, "LoRA is not enabled on this server (start it with --enable-lora).", None)
    await refresh_adapters(workers, RPC_TIMEOUT_S)
    return workers


def _had(worker: Worker, name: str) -> bool:
    return any(a.name == name for a in worker.info.lora_adapters)


def _success(gw: Gateway) -> web.Response:
    adapters = loaded_adapters(gw.backend.serving_workers())
    return web.json_response({"success": True, "error_message": None,
                              "loaded_adapters": {name: a.path for name, a in sorted(adapters.items())}})


def _failure(message: str, param: str) -> web.Response:
    # SGLang's fields beside the gateway's usual error body, so clients of either find the reason.
    return web.json_response({**ApiError(400, message, param).body(), "success": False, "error_message": message,
                              "loaded_adapters": None}, status=400)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
