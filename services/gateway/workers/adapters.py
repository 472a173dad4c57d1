"""Which LoRA adapter a request names, from what the workers report.

The workers own the adapters; the gateway knows them from each worker's Info (refreshed whenever a worker joins) and
from the replies of its load and unload calls (admin.py, for apis/admin/lora.py). Another process of the gateway
(--gateway-workers) or another replica may load or unload adapters meanwhile, so the lists are read again from the
workers (`refresh_adapters`) when a request names an adapter this process does not know, before an admin call
changes them, and for /v1/models; a request naming an adapter unloaded elsewhere is refused by the worker itself
(400, it is not loaded). An adapter is servable when every healthy worker of the serving roles has it at one
version, so a request never reaches a worker without it, and a prefill and a decode worker never disagree on its
weights. A request names its adapter by `model` ("base:adapter" or "adapter") or by `lora_path` (a name, or the
directory an adapter was loaded from): a server path that was never loaded is refused, so client input never makes a
worker read a file."""
from __future__ import annotations

import asyncio
from typing import Iterable

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers.pool import Worker


def loaded_adapters(workers: list[Worker]) -> dict[str, pb.LoraAdapterInfo]:
    """The adapters every healthy one of the serving `workers` has loaded at the same version, by name."""
    infos = [w.info for w in workers if w.healthy and w.info is not None]
    if not infos:
        return {}
    common = {a.name: a for a in infos[0].lora_adapters}
    for info in infos[1:]:
        theirs = {(a.name, a.version) for a in info.lora_adapters}
        common = {name: a for name, a in common.items() if (name, a.version) in theirs}
    return common


async def refresh_adapters(workers: list[Worker], timeout_s: float) -> None:
    """Read again from each healthy worker of `workers` (its Info) the adapters it has loaded now."""
    healthy = [w for w in workers if w.healthy and w.info is not None]
    replies = await asyncio.gather(*(w.stub.Info(pb.Empty(), timeout=timeout_s) for w in healthy),
                                   return_exceptions=True)
    for worker, reply in zip(healthy, replies):
        if isinstance(reply, pb.InfoReply):  # a worker that does not answer keeps what was known
            set_adapters(worker, reply.lora_adapters)


def set_adapters(worker: Worker, adapters: Iterable[pb.LoraAdapterInfo]) -> None:
    del worker.info.lora_adapters[:]
    worker.info.lora_adapters.extend(adapters)


def lora_enabled(workers: list[Worker]) -> bool:
    infos = [w.info for w in workers if w.info is not None]
    return bool(infos) and all(info.lora_enabled for info in infos)


class UnknownModel(ApiError):
    """A `model` that names neither the served model nor a loaded adapter: SGLang's 400 where the server was
    given --served-model-name; without one, the caller serves the request with the base model."""

    def __init__(self, model: str, served: str, adapters: list[str]) -> None:
        listed = f" (or one of its LoRA adapters: {', '.join(f'`{a}`' for a in adapters)})" if adapters else ""
        super().__init__(400, f"The model `{model}` does not exist. The served model name is `{served}`{listed}.",
                         "model")


def adapter_of(model: str | None, lora_path: str | None, *, served: str, accepted: frozenset[str],
               workers: list[Worker]) -> str | None:
    """The adapter a request runs with (None: the base model). `served` is the gateway's model name, `accepted`
    every name of its base model, `workers` the serving workers. UnknownModel for a model that is neither the
    served one nor a loaded adapter; 400 for an adapter that is not loaded or two that disagree."""
    adapters = loaded_adapters(workers)
    from_model = None
    if model is not None and model not in accepted:
        base, sep, adapter = model.partition(":")
        if sep and base in accepted and adapter:
            from_model = adapter
        elif model in adapters:
            from_model = model
        else:
            raise UnknownModel(model, served, sorted(adapters))
    from_path = _by_path(workers, adapters, lora_path) if lora_path is not None else None
    if from_model is not None and from_path is not None and from_model != from_path:
        raise ApiError(400, f"'model' names LoRA adapter {from_model!r} but 'lora_path' names {from_path!r}.",
                       "lora_path")
    if from_model is not None and from_model not in adapters:
        raise _not_loaded(workers, adapters, from_model, "model")
    return from_model or from_path


def _by_path(workers: list[Worker], adapters: dict[str, pb.LoraAdapterInfo], ref: str) -> str:
    """An adapter named by `lora_path`: its name, or the directory it was loaded from."""
    if not isinstance(ref, str) or not ref:
        raise ApiError(400, "'lora_path' must be the name (or loaded path) of a LoRA adapter.", "lora_path")
    if ref in adapters:
        return ref
    by_path = [a.name for a in adapters.values() if a.path.rstrip("/") == ref.rstrip("/")]
    if by_path:
        return by_path[0]
    raise _not_loaded(workers, adapters, ref, "lora_path")


def _not_loaded(workers: list[Worker], adapters: dict[str, pb.LoraAdapterInfo], name: str, param: str) -> ApiError:
    if not lora_enabled(workers):
        return ApiError(400, f"LoRA adapter {name!r} requested, but LoRA is not enabled on this server (start it "
                             "with --enable-lora or --lora-paths).", param)
    loaded = ", ".join(map(repr, sorted(adapters))) or "none"
    return ApiError(400, f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); load it with "
                         "POST /load_lora_adapter.", param)
