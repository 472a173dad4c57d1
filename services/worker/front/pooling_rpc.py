"""gRPC adapter of the Pooling service: prefill-only requests (scores, embeddings, classifier outputs).

On a generative worker (colocated or prefill) `Encode` scores through the engine process
(`EngineCalls.call_encode`: each input prefilled through the runtime in groups of at most one prefill chunk, so
running generations keep stepping in between); a pooling decoder (--is-embedding on a decoder, or a sequence
classifier) is served the same way, its output being the last token's hidden state or scores instead of label
log-probabilities. On an encoder worker (--is-embedding) `encode` queues the inputs on its Encoder, which batches
them with whatever else is queued. A decode worker refuses: these requests never need one.
"""
from __future__ import annotations

from typing import Awaitable, Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.worker.front import spans
from pdserve.services.worker.channel.wire import EngineGone, RemoteError
from pdserve.services.worker.channel.messages import Encode

# (sequences, their segment ids or None, label token ids) -> {"vectors", "prompt_tokens", "cached_tokens"};
# failures as RemoteError, by kind.
Encoder = Callable[[list[list[int]], list[list[int]] | None, list[int]], Awaitable[dict]]
CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
         "timeout": grpc.StatusCode.DEADLINE_EXCEEDED}


class PoolingService(pb_grpc.PoolingServicer):
    def __init__(self, encode: Encoder, refusal: str | None = None) -> None:
        """`refusal`: why this worker takes no Encode call (a decode worker), if it takes none."""
        self.encode = encode
        self.refusal = refusal

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeReply:
        span = spans.start("encode", request.traceparent, {"pdserve.rid": request.rid,
                                                            "pdserve.inputs": len(request.inputs)})
        if span is None:
            return await self._encode(request, context)
        try:
            reply = await self._encode(request, context)
            span.set_attribute("pdserve.prompt_tokens", reply.prompt_tokens)
            return reply
        except BaseException as exc:
            spans.end_failed(span, f"{type(exc).__name__}: {exc}")
            span = None
            raise
        finally:
            if span is not None:
                span.end()

    async def _encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeReply:
        if self.refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refusal)
        seqs = [list(s.ids) for s in request.inputs]
        types = [list(s.type_ids) for s in request.inputs] if any(s.type_ids for s in request.inputs) else None
        try:
            done = await self.encode(seqs, types, list(request.label_token_ids))
        except RemoteError as exc:
            await context.abort(CODES.get(exc.kind, grpc.StatusCode.INTERNAL), str(exc))
        except EngineGone as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request was not computed in time")
        return pb.EncodeReply(outputs=[pb.Vector(values=v) for v in done["vectors"]],
                              prompt_tokens=done["prompt_tokens"], cached_tokens=done["cached_tokens"])


def engine_encode(link, timeout_s: float = 120.0) -> Encoder:
    """A generative worker's Encode: through its engine process, `timeout_s` per input at most."""
    async def encode(seqs, types, labels) -> dict:
        if types is not None:
            raise RemoteError("invalid", "segment ids (type_ids) need an encoder model (a worker started with "
                                         "--is-embedding)")
        return await link.call(Encode(seqs, labels), timeout_s * (1 + len(seqs)))
    return encode
