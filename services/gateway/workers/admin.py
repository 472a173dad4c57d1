"""The deployment-wide calls of the admin routes: one RPC on every worker at once, and each worker's answer in
words (or the error a client is shown). The routes (apis/admin/) decide what to do with the answers: undo a
load that some worker refused, sum the expert counts, step a weight update through its phases.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers.adapters import set_adapters
from pdserve.services.gateway.workers.pool import Worker

LORA_TIMEOUT_S = 60.0  # an adapter load reads and checks its files on the worker's engine
EXPERTS_TIMEOUT_S = 30.0

# The steps of a weight update (apis/admin/weights.py), as the workers name them.
WEIGHTS_PREPARE, WEIGHTS_COMMIT, WEIGHTS_DISCARD = pb.WEIGHTS_PREPARE, pb.WEIGHTS_COMMIT, pb.WEIGHTS_DISCARD


# ---------------------------------------------------------------- LoRA adapters
async def load_adapter(workers: list[Worker], name: str, path: str) -> list[str]:
    """Load adapter `name` from `path` on every worker: each one's error, or "" where it loaded. Each worker's
    adapter list is updated from its reply."""
    return await _lora(workers, lambda w: w.stub.LoadLoraAdapter(pb.LoadLoraRequest(name=name, path=path),
                                                                 timeout=LORA_TIMEOUT_S))


async def unload_adapter(workers: list[Worker], name: str) -> list[str]:
    """Unload adapter `name` on every worker: each one's error, or ""."""
    return await _lora(workers, lambda w: w.stub.UnloadLoraAdapter(pb.UnloadLoraRequest(name=name),
                                                                   timeout=LORA_TIMEOUT_S))


async def _lora(workers: list[Worker], rpc) -> list[str]:
    replies = await asyncio.gather(*(rpc(w) for w in workers), return_exceptions=True)
    errors = []
    for worker, reply in zip(workers, replies):
        if isinstance(reply, pb.LoraReply):
            set_adapters(worker, reply.adapters)
            errors.append(reply.error if not reply.ok else "")
        elif isinstance(reply, grpc.aio.AioRpcError):
            errors.append(f"worker {worker.address}: {reply.details() or reply.code().name}")
        else:
            errors.append(f"worker {worker.address}: {reply}")
    return errors


# ---------------------------------------------------------------- expert distribution recording
async def experts(workers: list[Worker], call: str) -> list:
    """Expert recording `call` ("start", "stop" or "dump") on every worker at once: each one's reply (an
    ExpertDumpReply for "dump"), or the ApiError its failure maps to."""
    method = {"start": "StartExpertRecord", "stop": "StopExpertRecord", "dump": "DumpExpertRecord"}[call]
    replies = await asyncio.gather(*(getattr(w.stub, method)(pb.Empty(), timeout=EXPERTS_TIMEOUT_S)
                                     for w in workers), return_exceptions=True)
    return [_expert_error(w, r) if isinstance(r, BaseException) else r for w, r in zip(workers, replies)]


def _expert_error(worker: Worker, exc: BaseException) -> ApiError:
    if not isinstance(exc, grpc.aio.AioRpcError):
        return ApiError(500, f"{worker.role} worker {worker.address} failed: {exc}")
    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # no experts, or the mode is off: the worker says which
        return ApiError(400, exc.details() or "The workers cannot record expert distributions.")
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return ApiError(400, f"The {worker.role} worker {worker.address} does not record expert distributions.")
    return ApiError(503, f"{worker.role} worker {worker.address}: {exc.details() or exc.code().name}")


# ---------------------------------------------------------------- weight updates
@dataclass
class Outcome:
    """One worker's answer to one step of a weight update."""

    worker: Worker
    ok: bool
    error: str = ""
    path_not_found: bool = False


async def weights_step(workers: list[Worker], step: int, model_path: str, timeout: float,
                       abort_all_requests: bool = False, version: int = 0, tag: str = "") -> list[Outcome]:
    """UpdateWeights `step` on every worker at once; each worker's Info is brought up to date from its reply."""
    request = pb.UpdateWeightsRequest(step=step, model_path=model_path, abort_all_requests=abort_all_requests,
                                      version=version, tag=tag)
    replies = await asyncio.gather(*(w.stub.UpdateWeights(request, timeout=timeout) for w in workers),
                                   return_exceptions=True)
    return [_outcome(w, r) for w, r in zip(workers, replies)]


def _outcome(worker: Worker, reply) -> Outcome:
    if isinstance(reply, pb.UpdateWeightsReply):
        worker.info.weights.CopyFrom(reply.weights)
        worker.info.model_path = reply.weights.path
        return Outcome(worker, reply.ok, reply.error, reply.path_not_found)
    if isinstance(reply, grpc.aio.AioRpcError):
        if reply.code() == grpc.StatusCode.UNIMPLEMENTED:
            return Outcome(worker, False, f"the {worker.role} worker {worker.address} cannot update its weights")
        return Outcome(worker, False, f"{worker.role} worker {worker.address}: {reply.details() or reply.code().name}")
    return Outcome(worker, False, f"{worker.role} worker {worker.address}: {reply}")
