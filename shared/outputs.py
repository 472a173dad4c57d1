"""What leaves the runtime for a request: tokens with their logprobs, and a prefill worker's result.

Plain data, no torch: the wire codec (`pdserve.proto.codec`) and the gateway use these types too.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# An output error that starts so does not fail the generation: it froze here at a step boundary, its KV kept, to
# continue on another decode worker (a live move, shared/roles/move_out.py); what follows names why (drain,
# rebalance). The worker ends its stream ABORTED with it, and the gateway continues the generation elsewhere.
MOVED = "moved: "


def is_moved(error: str | None) -> bool:
    return bool(error) and error.startswith(MOVED)


@dataclass
class TokenLogprobs:
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    id_logprobs: list[float] = field(default_factory=list)  # at the request's token_ids_logprob, in its order

    def to_wire(self) -> tuple:
        """Plain values for a pipe between processes."""
        return self.logprob, self.top_ids, self.top_logprobs, self.id_logprobs

    @classmethod
    def from_wire(cls, items) -> TokenLogprobs:
        return cls(items[0], list(items[1]), list(items[2]), list(items[3]))


@dataclass
class ReqOutput:
    """New tokens of one request since its previous output."""

    rid: str
    index: int  # choice index (n > 1)
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop_token: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    input_logprobs: list[TokenLogprobs] | None = None  # first output only: prompt tokens from max(start, 1) on
    # First output only: this worker's part of the time to first token. queue_s: arrival to the first prompt chunk
    # (or, on a decode worker, to its pages being reserved and its prefill asked for); compute_s: that chunk to
    # the first token, when the prompt was computed here.
    queue_s: float = 0.0
    compute_s: float = 0.0
    first_token_time: float | None = None  # monotonic, first output only
    arrival: float | None = None  # monotonic, first output only
    # First output only: of cached_tokens, those a lower tier put back into the pool for it (Req.tier_tokens).
    tier_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class FirstToken:
    """A token sampled by a prefill worker for one choice of a request."""

    token_id: int
    logprob: TokenLogprobs | None = None


@dataclass
class PrefillResult:
    first_tokens: list[FirstToken]
    cached_tokens: int
    queue_s: float
    compute_s: float
    transfer_s: float = 0.0
    input_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt logprobs, when asked for


def coalesce(outputs: list[ReqOutput]) -> list[ReqOutput]:
    """Consecutive outputs of one request as one per choice: their tokens and logprobs in order, the last finish
    reason, the prompt's logprobs of the first that carries them. For a stream that fell behind (or a
    --stream-interval above 1): one message instead of one per token."""
    merged: dict[int, ReqOutput] = {}
    for out in outputs:
        into = merged.get(out.index)
        if into is None:
            merged[out.index] = ReqOutput(out.rid, out.index, list(out.token_ids), list(out.logprobs),
                                          out.finish_reason, out.matched_stop_token, out.prompt_tokens,
                                          out.cached_tokens, out.error, out.input_logprobs)
            continue
        into.token_ids += out.token_ids
        into.logprobs += out.logprobs
        into.finish_reason, into.matched_stop_token = out.finish_reason, out.matched_stop_token
        into.error = into.error or out.error
        into.input_logprobs = into.input_logprobs or out.input_logprobs
    return list(merged.values())


def acceptance(drafting_reqs: int, drafted: int, accepted: int) -> tuple[float, float]:
    """Speculative decoding's figures, as a worker reports them (SGLang's): accept length, the tokens a drafting
    request gains per verify step (its drafts accepted, plus the token it samples anyway), and accept rate, draft
    tokens accepted over drafted; (1.0, 0.0) before any draft."""
    return (1 + accepted / drafting_reqs if drafting_reqs else 1.0), (accepted / drafted if drafted else 0.0)
