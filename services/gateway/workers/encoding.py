"""Encode: token sequences in, one vector per sequence out, on a worker that holds the model's prefix cache
(colocated, or prefill in PD mode), for the pooling and classification routes (apis/pooling/).

One call holds one admission place of the backend meanwhile (429 when the workers are full). It goes to the
least loaded worker; a worker that fails as if down is probed and left out of the next try (as a generation's
first attempt is, generation.py); a worker's refusal (a bad input: 400; full: 429) ends the call, as it
ends a generation (`generation.refusal`).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services import tracing
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers.backend import Backend
from pdserve.services.gateway.workers.generation import refusal
from pdserve.services.gateway.workers.pool import Worker
from pdserve.services.gateway.workers.router import load_of

ENCODE_TIMEOUT_S = 300.0


@dataclass
class Encoded:
    outputs: list[list[float]]
    prompt_tokens: int


async def encode(backend: Backend, rid: str, seqs: list[list[int]], label_token_ids: list[int] = (),
                 type_ids: list[list[int]] | None = None) -> Encoded:
    """Run `seqs` (label-token log-probabilities for a score, else the pooled embedding of each). `type_ids`:
    segment ids per token, for cross-encoder pairs."""
    async with backend.encoding():
        return await _encode(backend, rid, seqs, label_token_ids, type_ids)


async def _encode(backend: Backend, rid: str, seqs: list[list[int]], label_token_ids: list[int],
                  type_ids: list[list[int]] | None) -> Encoded:
    tried: set[str] = set()
    for _ in range(backend.settings.max_attempts):
        worker = _pick(backend, tried)
        tried.add(worker.address)
        stub = pb_grpc.PoolingStub(worker.channel)
        types = type_ids or [[] for _ in seqs]
        message = pb.EncodeRequest(rid=rid, inputs=[pb.TokenSeq(ids=s, type_ids=t) for s, t in zip(seqs, types)],
                                   label_token_ids=list(label_token_ids))
        worker.in_flight += 1
        try:
            with tracing.section("encode", worker=worker.address, inputs=len(seqs)) as span:
                message.traceparent = tracing.traceparent_of(span)
                reply = await stub.Encode(message, timeout=ENCODE_TIMEOUT_S)
            return Encoded([list(v.values) for v in reply.outputs], reply.prompt_tokens)
        except grpc.aio.AioRpcError as exc:
            refused = refusal(exc, backend.settings.retry_after_s)
            if refused is not None:
                raise refused from None
            if exc.code() != grpc.StatusCode.UNAVAILABLE:  # alive but failing: another try would fail the same way
                raise ApiError(503, f"{worker.role} worker {worker.address} failed: "
                                    f"{exc.details() or exc.code().name}.") from None
            await backend.probe(worker)
        finally:
            worker.in_flight -= 1
    raise ApiError(503, "No worker could serve the request (tried " + ", ".join(sorted(tried)) + ").")


def _pick(backend: Backend, tried: set[str]) -> Worker:
    workers = [w for w in backend.healthy_cache_workers() if w.address not in tried]
    if not workers:
        raise ApiError(503, f"No healthy {backend.cache_role} worker is available to serve the request.")
    return min(workers, key=lambda w: (load_of(w), w.address))
