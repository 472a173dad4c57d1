"""What every generative worker's engine serves, whatever its role: generations (Generate, Abort, Trace), pooling
(Encode) and Stop; what only a prefill or a decode engine serves is in the role's module (`prefill_engine.py`,
`decode_engine.py`), what operators ask in `engine_admin_calls.py`.

Each handler is marked with the call type it takes (`handles`); the channel's host finds it by that type. Results
are plain data (msgpack); a failure reaches the front as its kind and message (`wire.error_kind`).
"""
from __future__ import annotations

from concurrent.futures import Future

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import params_from_proto
from pdserve.services.worker.channel.messages import Abort, Encode, Generate, Stop, Trace
from pdserve.services.worker.engine.engine_worker import WorkerEngine, handles
from pdserve.shared.outputs import TokenLogprobs
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scoring import (ScoreResult, check_inputs, check_sequences, plan_groups, pool_group,
                                    prefill_prefix, score_group, step_budget)

ENCODE_TIMEOUT_S = 120.0  # for one group of a pooling request, queueing included


def params_of(sampling: bytes) -> SamplingParams:
    """A request's sampling parameters from the serialized pb.SamplingParams its gRPC call brought: the one
    conversion a worker makes (validated once the engine adds the request, against the model too)."""
    return params_from_proto(pb.SamplingParams.FromString(sampling))


def lps(items) -> TokenLogprobs | None:
    return None if items is None else TokenLogprobs.from_wire(items)


def wire_lps(lp: TokenLogprobs | None):
    return None if lp is None else lp.to_wire()


class GenerationCalls:
    def __init__(self, worker: WorkerEngine) -> None:
        self.worker = worker

    @handles(Generate, where="here")
    def generate(self, call: Generate) -> Future:
        w = self.worker
        req = Req(rid=call.rid, input_ids=list(call.input_ids), params=params_of(call.sampling),
                  arrival=call.arrival, on_output=w.emit, moved_in=call.kv_source)
        w.role.admitting(req)

        def add() -> None:
            resume = None if call.resume is None else [(index, list(ids)) for index, ids in call.resume]
            w.engine.add_request(req, call.lora or None, resume=resume)
            if call.traced:
                w.traced[call.rid] = req
        return w.admit(req, add)

    @handles(Abort)
    def abort(self, call: Abort) -> list[str]:
        return self.worker.abort(call.rids, call.error)

    @handles(Trace)
    def trace(self, call: Trace) -> dict | None:
        """What the front's span of a finished generation says, from its Req (spans.ReqTrace)."""
        req = self.worker.traced.pop(call.rid, None)
        return None if req is None else trace_of(req)

    @handles(Stop, where="here")
    def stop(self, call: Stop) -> None:
        self.worker.stop_asked = True

    # ------------------------------------------------------------ pooling: scores and embeddings
    @handles(Encode, where="thread")
    def encode(self, call: Encode) -> dict:
        """Each input prefilled through the runtime in groups of at most one prefill chunk of tokens, one engine
        call per group (and per chunk of a longer input), so running generations keep stepping in between."""
        w, seqs, labels = self.worker, call.seqs, call.labels
        engine, mc = w.engine, w.engine.model_config
        if w.pooled is not None:
            if labels:
                raise ValueError(f"this worker serves {w.pooled.kind}: scoring label tokens needs a generative "
                                 "model")
            check_sequences(seqs, mc.vocab_size, w.runner.context_length)
            run = lambda part: pool_group(engine, part, w.pooled.normalize)  # noqa: E731
        elif not labels:
            raise ValueError("this worker serves a generative model: embeddings need a worker started with "
                             "--is-embedding on an embedding model")
        else:
            check_inputs(seqs, labels, mc.vocab_size, w.runner.context_length)
            run = lambda part: score_group(engine, part, labels)  # noqa: E731
        budget = step_budget(w.config.scheduler)
        vectors: list[list[float]] = []
        prompt = cached = 0
        for group in plan_groups([len(s) for s in seqs], budget):
            part = [seqs[i] for i in group]
            for end in range(budget, len(part[0]), budget) if len(part) == 1 else ():
                w.on_engine(lambda end=end, seq=part[0]: prefill_prefix(engine, seq[:end]), ENCODE_TIMEOUT_S)
            result: ScoreResult = w.on_engine(lambda part=part: run(part), ENCODE_TIMEOUT_S)
            vectors += result.logprobs
            prompt += result.prompt_tokens
            cached += result.cached_tokens
        return {"vectors": vectors, "prompt_tokens": prompt, "cached_tokens": cached}


def trace_of(req: Req, dst_pages: int = 0) -> dict:
    """`dst_pages`: a prefill's, the decode worker's pages it filled."""
    return {"arrival": req.arrival, "first_scheduled": req.first_scheduled, "first_token_time": req.first_token_time,
            "pages_reserved": req.pages_reserved, "prompt_tokens": len(req.input_ids),
            "cached_tokens": req.cached_tokens, "tier_tokens": dict(req.tier_tokens),
            "output_tokens": len(req.output_ids), "pages": len(req.pages),
            "prefill_chunks": [list(c) for c in req.prefill_chunks], "decode_steps": req.decode_steps,
            "drafted_tokens": req.drafted_tokens, "accepted_tokens": req.accepted_tokens,
            "finish_reason": req.finish_reason,
            "dst_pages": dst_pages}
