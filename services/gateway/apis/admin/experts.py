"""SGLang's expert-distribution recording endpoints, over every serving worker at once.

GET or POST /start_expert_distribution_record, /stop_expert_distribution_record and
/dump_expert_distribution_record, for MoE models on workers started with --expert-distribution-recorder-mode
stat. Each worker counts the routing choices of the forward passes it runs (in PD mode prefill counts the
prompts, decode the generated tokens); the dump sums every worker's [layers, experts] counts and writes the sum
as SGLang's stat file, `expert_distribution_recorder_<time>.pt`, into the directory the workers write theirs to
(--expert-distribution-recorder-dir). Start is on every worker or on none. The answers are SGLang's plain-text
lines; the dump's goes on with where the merged file is and what it holds. A dense model, or workers started
without the mode, get a 400 saying so.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from pdserve.services.gateway.apis.context import GATEWAY, Gateway
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers import admin
from pdserve.services.gateway.workers.pool import Worker


async def start_record(request: web.Request) -> web.Response:
    workers = _reachable(request.app[GATEWAY])
    replies = await admin.experts(workers, "start")
    failed = [r for r in replies if isinstance(r, ApiError)]
    if failed:  # on none: stop those that started
        await admin.experts([w for w, r in zip(workers, replies) if not isinstance(r, ApiError)], "stop")
        raise failed[0]
    return web.Response(text="Start recording the expert distribution.\n")


async def stop_record(request: web.Request) -> web.Response:
    _first_error(await admin.experts(_reachable(request.app[GATEWAY]), "stop"))
    return web.Response(text="Stop recording the expert distribution.\n")


async def dump_record(request: web.Request) -> web.Response:
    workers = _reachable(request.app[GATEWAY])
    replies = _first_error(await admin.experts(workers, "dump"))
    shapes = {tuple(r.shape) for r in replies}
    if len(shapes) != 1:
        raise ApiError(500, f"The workers count different shapes of experts ({sorted(shapes)}): they do not serve "
                            "one model.")
    (layers, experts), = shapes
    total = [sum(column) for column in zip(*(r.counts for r in replies))]  # row-major [layers, experts]
    directory = Path(replies[0].path).parent
    try:
        path = await asyncio.to_thread(_save, total, layers, experts, directory)
    except (OSError, ValueError) as exc:
        raise ApiError(500, f"Cannot write the merged expert distribution to {str(directory)!r}: {exc}.") from None
    lines = ["Dump expert distribution record.", f"file: {path}",
             f"layers: {layers}, experts: {experts}, selections: {sum(total)}"]
    lines += [f"worker {w.role} {w.address}: {sum(r.counts)} selections, file {r.path}"
              for w, r in zip(workers, replies)]
    return web.Response(text="\n".join(lines) + "\n")


def _save(total: list[int], layers: int, experts: int, directory: Path) -> Path:
    # torch only to write SGLang's .pt file, when a dump is asked for: the gateway process never needs it otherwise.
    import torch

    from pdserve.shared.expert_recorder import save_dump

    return save_dump(torch.tensor(total, dtype=torch.int64).view(layers, experts), directory)


def _reachable(gw: Gateway) -> list[Worker]:
    workers = gw.backend.serving_workers()
    down = [w.address for w in workers if not w.healthy or w.info is None]
    if not workers or down:
        raise ApiError(503, f"Workers {', '.join(down) or '(none)'} are not serving; expert distributions are "
                            "recorded on every worker at once, so try again when all are healthy.")
    return workers


def _first_error(replies: list) -> list:
    for reply in replies:
        if isinstance(reply, ApiError):
            raise reply
    return replies


def add_routes(app: web.Application) -> None:
    for path, handler in (("/start_expert_distribution_record", start_record),
                          ("/stop_expert_distribution_record", stop_record),
                          ("/dump_expert_distribution_record", dump_record)):
        app.router.add_post(path, handler)
        app.router.add_get(path, handler)
