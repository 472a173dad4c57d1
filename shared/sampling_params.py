"""SamplingParams: how one request wants its tokens chosen, with the checks that make a value acceptable.

A SamplingParams is immutable and built once per request: by the gateway from API values, or by a worker
from the gRPC message (`from_proto`). `validate` is the single place where value ranges are decided; the
gateway and the workers both call it, so a bad value is refused with the same message wherever it enters.
Ranges follow SGLang's sampling parameters and the OpenAI API.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields

from pdserve.proto import worker_pb2 as pb

# Temperatures below this sample like greedy decoding (all the mass sits on the top token), as in SGLang.
GREEDY_TEMPERATURE = 1e-6
MAX_N = 128
MAX_TOP_LOGPROBS = 20
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class InvalidParam(ValueError):
    """A sampling parameter outside its range; `field` is the SamplingParams attribute at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 (or below 1e-6) is greedy decoding."""
    top_p: float = 1.0
    """Keep the tokens whose more likely tokens hold less than top_p of the probability mass; (0, 1]."""
    top_k: int = -1
    """Keep the tokens with fewer than top_k more likely tokens; -1 or 0 means no limit."""
    min_p: float = 0.0
    """Keep the tokens at least min_p times as likely as the most likely one; [0, 1]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output; [-2, 2]."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token present in the output; [-2, 2]."""
    repetition_penalty: float = 1.0
    """Logits of tokens in the prompt or output: positive ones divided by it, negative ones multiplied; (0, 2]."""
    max_new_tokens: int = 128
    """0 is allowed: the request ends at once with no tokens."""
    min_new_tokens: int = 0
    """Until this many tokens are out, eos (unless ignore_eos) and stop_token_ids cannot be sampled."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these ends the request (finish reason "stop"), as eos does."""
    ignore_eos: bool = False
    """Eos does not end the request."""
    seed: int | None = None
    """Same seed, params and model: the same tokens, whatever else runs in the batch."""
    n: int = 1
    """Number of choices sampled from one prompt; [1, 128]."""
    return_logprob: bool = False
    top_logprobs_num: int = 0
    """How many of the most likely tokens to report with each token's logprob; [0, 20]."""

    def __post_init__(self) -> None:
        # Callers pass lists (JSON arrays, repeated proto fields); a tuple keeps the params hashable.
        if not isinstance(self.stop_token_ids, tuple):
            try:
                object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
            except TypeError:
                pass  # validate() names the field

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidParam naming the first field outside its range; stop ids are checked against vocab_size."""
        _number("temperature", self.temperature, lo=0.0)
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _integer("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidParam("top_k", f"top_k must be -1 or 0 (no limit) or >= 1, got {self.top_k}")
        _number("min_p", self.min_p, lo=0.0, hi=1.0)
        _number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=2.0, lo_open=True)
        _integer("max_new_tokens", self.max_new_tokens, lo=0)
        _integer("min_new_tokens", self.min_new_tokens, lo=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidParam("min_new_tokens", f"min_new_tokens must be <= max_new_tokens "
                                                 f"({self.max_new_tokens}), got {self.min_new_tokens}")
        self._validate_stop_token_ids(vocab_size)
        _boolean("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            _integer("seed", self.seed, lo=_INT64_MIN, hi=_INT64_MAX)
        _integer("n", self.n, lo=1, hi=MAX_N)
        _boolean("return_logprob", self.return_logprob)
        _integer("top_logprobs_num", self.top_logprobs_num, lo=0, hi=MAX_TOP_LOGPROBS)

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidParam("stop_token_ids", f"stop_token_ids must be a list of token ids, "
                                                 f"got {self.stop_token_ids!r}")
        hi = _INT32_MAX if vocab_size is None else vocab_size - 1
        for token in self.stop_token_ids:
            if not _is_int(token) or not 0 <= token <= hi:
                raise InvalidParam("stop_token_ids", f"stop_token_ids must hold token ids in [0, {hi}], "
                                                     f"got {token!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    """An integer in [lo, hi]; a missing bound is int32's, so that the value fits the gRPC message."""
    if not _is_int(value):
        raise InvalidParam(name, f"{name} must be an integer, got {value!r}")
    low = -_INT32_MAX - 1 if lo is None else lo
    high = _INT32_MAX if hi is None else hi
    if low <= value <= high:
        return
    if lo is not None and hi is not None:
        raise InvalidParam(name, f"{name} must be in [{lo}, {hi}], got {value}")
    if value < low:
        raise InvalidParam(name, f"{name} must be >= {low}, got {value}")
    raise InvalidParam(name, f"{name} must be <= {high}, got {value}")


def _number(name: str, value: object, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParam(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParam(name, f"{name} must be a finite number, got {value}")
    below = value <= lo if lo_open else value < lo
    if hi is None and below:
        raise InvalidParam(name, f"{name} must be >= {_fmt(lo)}, got {value}")
    if hi is not None and (below or value > hi):
        left = "(" if lo_open else "["
        raise InvalidParam(name, f"{name} must be in {left}{_fmt(lo)}, {_fmt(hi)}], got {value}")


def _boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidParam(name, f"{name} must be true or false, got {value!r}")


def _fmt(bound: float) -> str:
    return f"{bound:g}"


# ------------------------------------------------------------------ gRPC message
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_PLAIN_FIELDS = ("top_k", "max_new_tokens", "min_new_tokens", "ignore_eos", "n", "return_logprob",
                 "top_logprobs_num")


def to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The message the gateway sends; every field is filled, so proto3's zero defaults never stand in for a value."""
    values = {f.name: getattr(params, f.name) for f in fields(params)}
    msg = pb.SamplingParams(**{k: values[k] for k in _FLOAT_FIELDS + _PLAIN_FIELDS},
                            stop_token_ids=list(params.stop_token_ids))
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from a fully filled message; raises InvalidParam for an out-of-range value."""
    params = SamplingParams(**{k: _from_float32(getattr(msg, k)) for k in _FLOAT_FIELDS},
                            **{k: getattr(msg, k) for k in _PLAIN_FIELDS},
                            stop_token_ids=tuple(msg.stop_token_ids),
                            seed=msg.seed if msg.HasField("seed") else None)
    params.validate()
    return params


def _from_float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32, so 0.7 sent as float32 arrives as 0.7 again."""
    target = struct.pack("<f", value)
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == target:
            return short
    return value
