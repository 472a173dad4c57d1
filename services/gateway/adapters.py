"""Which LoRA adapter a request names, from what the workers report.

The workers own the adapters; the gateway knows them from each worker's Info (refreshed whenever a worker
joins) and from the replies of its load and unload calls (lora_api.py). An adapter is servable when every
healthy worker of the serving roles has it at one version, so a request never reaches a worker without it,
and a prefill and a decode worker never disagree on its weights. A request names its adapter by `model`
("base:adapter" or "adapter") or by `lora_path` (a name, or the directory an adapter was loaded from): a
server path that was never loaded is refused, so client input never makes a worker read a file.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers import Worker, WorkerPool

if TYPE_CHECKING:
    from pdserve.services.gateway.context import Gateway


def serving_workers(pool: WorkerPool) -> list[Worker]:
    roles = ("colocated",) if pool.mode == "colocated" else ("prefill", "decode")
    return [w for role in roles for w in pool.of_role(role)]


def loaded_adapters(pool: WorkerPool) -> dict[str, pb.LoraAdapterInfo]:
    """The adapters every healthy serving worker has loaded at the same version, by name."""
    infos = [w.info for w in serving_workers(pool) if w.healthy and w.info is not None]
    if not infos:
        return {}
    common = {a.name: a for a in infos[0].lora_adapters}
    for info in infos[1:]:
        theirs = {(a.name, a.version) for a in info.lora_adapters}
        common = {name: a for name, a in common.items() if (name, a.version) in theirs}
    return common


def lora_enabled(pool: WorkerPool) -> bool:
    infos = [w.info for w in serving_workers(pool) if w.info is not None]
    return bool(infos) and all(info.lora_enabled for info in infos)


def adapter_of(gw: Gateway, model: str | None, lora_path: str | None = None) -> str | None:
    """The adapter a request runs with (None: the base model). 404 for a model that is neither the served one
    nor a loaded adapter; 400 for an adapter that is not loaded or two that disagree."""
    from_model = None
    if model is not None and model not in gw.accepted_model_names:
        base, sep, adapter = model.partition(":")
        if sep and base in gw.accepted_model_names and adapter:
            from_model = adapter
        elif model in loaded_adapters(gw.backend.pool):
            from_model = model
        else:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {gw.served_model_name!r}"
                                f"{_adapter_list(gw)}.", "model")
    from_path = _by_path(gw, lora_path) if lora_path is not None else None
    if from_model is not None and from_path is not None and from_model != from_path:
        raise ApiError(400, f"'model' names LoRA adapter {from_model!r} but 'lora_path' names {from_path!r}.",
                       "lora_path")
    if from_model is not None and from_model not in loaded_adapters(gw.backend.pool):
        raise _not_loaded(gw, from_model, "model")
    return from_model or from_path


def _by_path(gw: Gateway, ref: str) -> str:
    """An adapter named by `lora_path`: its name, or the directory it was loaded from."""
    if not isinstance(ref, str) or not ref:
        raise ApiError(400, "'lora_path' must be the name (or loaded path) of a LoRA adapter.", "lora_path")
    adapters = loaded_adapters(gw.backend.pool)
    if ref in adapters:
        return ref
    by_path = [a.name for a in adapters.values() if a.path.rstrip("/") == ref.rstrip("/")]
    if by_path:
        return by_path[0]
    raise _not_loaded(gw, ref, "lora_path")


def _not_loaded(gw: Gateway, name: str, param: str) -> ApiError:
    pool = gw.backend.pool
    if not lora_enabled(pool):
        return ApiError(400, f"LoRA adapter {name!r} requested, but LoRA is not enabled on this server (start it "
                             "with --enable-lora or --lora-paths).", param)
    loaded = ", ".join(map(repr, sorted(loaded_adapters(pool)))) or "none"
    return ApiError(400, f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); load it with "
                         "POST /load_lora_adapter.", param)


def _adapter_list(gw: Gateway) -> str:
    names = sorted(loaded_adapters(gw.backend.pool))
    return f" and the LoRA adapters {', '.join(map(repr, names))}" if names else ""
