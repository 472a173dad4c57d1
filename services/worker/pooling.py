"""gRPC adapter of the Pooling service: prefill-only requests (scores, embeddings, classifier outputs).

On a generative worker (colocated or prefill) `Encode` scores: each input is prefilled through the engine's
runtime, in groups of at most one prefill chunk (--chunked-prefill-size) of tokens, one engine call per group
(and per chunk of a longer input) so running generations keep stepping in between. A pooling decoder (--is-embedding on a decoder, or a sequence classifier) is served
the same way, its output being the last token's hidden state or scores instead of label log-probabilities.
On an encoder worker (--is-embedding) it queues the inputs on the Encoder, which batches them with whatever
else is queued. A decode worker refuses: these requests never need one.
"""
from __future__ import annotations

import asyncio

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.worker import spans
from pdserve.shared.config import Role
from pdserve.shared.encoder import Encoder
from pdserve.shared.engine import Engine
from pdserve.shared.scoring import (DecoderPooling, PoolBusy, ScoreResult, check_inputs, check_sequences,
                                    plan_groups, pool_group, prefill_prefix, score_group, step_budget)


class PoolingService(pb_grpc.PoolingServicer):
    def __init__(self, role: Role, engine: Engine | None = None, encoder: Encoder | None = None,
                 timeout_s: float = 120.0, pooled: DecoderPooling | None = None) -> None:
        self.role = role
        self.engine = engine
        self.encoder = encoder
        self.pooled = pooled  # set when the engine's model is a pooling decoder
        self.timeout_s = timeout_s  # for one group to be computed, queueing included

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
        seqs = [list(s.ids) for s in request.inputs]
        types = [list(s.type_ids) for s in request.inputs] if any(s.type_ids for s in request.inputs) else None
        labels = list(request.label_token_ids)
        try:
            if self.encoder is not None:
                if labels:
                    raise ValueError("this worker serves an embedding model: scoring label tokens needs a "
                                     "generative model")
                vectors = await self._wait(self.encoder.submit(seqs, types))
                return _reply(vectors, sum(len(s) for s in seqs), 0)
            if self.role == Role.DECODE:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "this is a decode worker: send prefill-only requests to a prefill or "
                                    "colocated worker")
            if types is not None:
                raise ValueError("segment ids (type_ids) need an encoder model (a worker started with --is-embedding)")
            if self.pooled is not None:
                if labels:
                    raise ValueError(f"this worker serves {self.pooled.kind}: scoring label tokens needs a "
                                     "generative model")
                return await self._pool(seqs)
            if not labels:
                raise ValueError("this worker serves a generative model: embeddings need a worker started "
                                 "with --is-embedding on an embedding model")
            return await self._score(seqs, labels)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except PoolBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request was not computed in time")
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))

    async def _score(self, seqs: list[list[int]], labels: list[int]) -> pb.EncodeReply:
        engine = self.engine
        check_inputs(seqs, labels, engine.model_config.vocab_size, engine.runner.context_length)
        return await self._groups(seqs, lambda part: score_group(engine, part, labels))

    async def _pool(self, seqs: list[list[int]]) -> pb.EncodeReply:
        engine = self.engine
        check_sequences(seqs, engine.model_config.vocab_size, engine.runner.context_length)
        return await self._groups(seqs, lambda part: pool_group(engine, part, self.pooled.normalize))

    async def _groups(self, seqs: list[list[int]], run) -> pb.EncodeReply:
        """`run` on each group of `seqs`, one engine call per group of at most one prefill chunk of tokens; a
        longer sequence goes alone, its leading chunks computed into the prefix cache by calls of their own."""
        engine = self.engine
        budget = step_budget(engine.config.scheduler)
        vectors: list[list[float]] = []
        prompt = cached = 0
        for group in plan_groups([len(s) for s in seqs], budget):
            part = [seqs[i] for i in group]
            for end in range(budget, len(part[0]), budget) if len(part) == 1 else ():
                await self._wait(engine.call(lambda end=end, seq=part[0]: prefill_prefix(engine, seq[:end])))
            result: ScoreResult = await self._wait(engine.call(lambda part=part: run(part)))
            vectors += result.logprobs
            prompt += result.prompt_tokens
            cached += result.cached_tokens
        return _reply(vectors, prompt, cached)

    async def _wait(self, future):
        return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)


def _reply(vectors: list[list[float]], prompt_tokens: int, cached_tokens: int) -> pb.EncodeReply:
    return pb.EncodeReply(outputs=[pb.Vector(values=v) for v in vectors], prompt_tokens=prompt_tokens,
                          cached_tokens=cached_tokens)
