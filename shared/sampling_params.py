"""SamplingParams: how one request wants its tokens chosen, with the checks that make a value acceptable.

A SamplingParams is immutable and built once per request: by the gateway from API values, or by a worker
from the gRPC message (`pdserve.proto.codec`, which derives the message from these fields). `validate` is the
single place where value ranges are decided; the gateway and the workers both call it, so a bad value is refused
with the same message wherever it enters. Ranges follow SGLang's sampling parameters and the OpenAI API.

Adding a parameter: a field here with its line in `validate`, the same name in proto/worker.proto's SamplingParams
(the codec converts by name), and the sampler's code. The gateway's API fields are generated from these, under each
API's names (services/gateway/intake/dialects.py); tests/shared/test_param_definitions.py fails until the proto agrees,
and shows a new field reaching every API.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures below this sample like greedy decoding (all the mass sits on the top token), as in SGLang.
GREEDY_TEMPERATURE = 1e-6
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
# Token lists are checked at every generated token: 4M stop ids took 8 s to accept and stalled neighbours.
MAX_STOP_TOKEN_IDS = 256
# A score call's answer is an items x labels array of Python floats (~32 bytes each): 8 items x 4M labels took
# 1.5 GB of a worker. shared/scoring.py refuses more at the worker's edge.
MAX_SCORE_LABELS = 1024
MAX_SCORE_VALUES = 1 << 20  # items x labels of one call: ~32 MB as Python floats
# The grammar constraints; at most one per request (pdserve.shared.grammar compiles it).
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
_TOKEN_LISTS = ("stop_token_ids", "think_start_ids", "think_end_ids")
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
    logprob_start_len: int = -1
    """With return_logprob: report the logprobs of the prompt's tokens from this position on; -1: none."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, sorted: the bias is added to the token's logit before sampling; [-100, 100]."""
    json_schema: str | None = None
    """Constrain the output to JSON matching this schema (a JSON string)."""
    regex: str | None = None
    """Constrain the output to match this regular expression."""
    ebnf: str | None = None
    """Constrain the output to this EBNF grammar (GBNF dialect, `root` rule first)."""
    structural_tag: str | None = None
    """Constrain the parts of the output between begin/end tags (a JSON string, SGLang's structural_tag)."""
    think_start_ids: tuple[int, ...] = ()
    think_end_ids: tuple[int, ...] = ()
    """With a grammar and think_end_ids: the output may first reason, unconstrained, until think_end_ids; the
    grammar holds for what follows. With think_start_ids too, the reasoning happens only if the output opens
    with them (otherwise the grammar holds from the first token); without, the output starts in the reasoning."""

    def __post_init__(self) -> None:
        # Callers pass lists and dicts (JSON, proto fields); tuples keep the params hashable and comparable.
        for name in _TOKEN_LISTS:
            if not isinstance(getattr(self, name), tuple):
                try:
                    object.__setattr__(self, name, tuple(getattr(self, name)))
                except TypeError:
                    pass  # validate() names the field
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        if not isinstance(bias, tuple) or any(not isinstance(pair, tuple) for pair in bias):
            try:
                object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in bias)))
            except (TypeError, ValueError):
                pass  # validate() names the field

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, text) of the grammar constraint, if any."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

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
        for name in _TOKEN_LISTS:
            self._validate_token_ids(name, vocab_size)
        _boolean("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            _integer("seed", self.seed, lo=_INT64_MIN, hi=_INT64_MAX)
        _integer("n", self.n, lo=1, hi=MAX_N)
        _boolean("return_logprob", self.return_logprob)
        _integer("top_logprobs_num", self.top_logprobs_num, lo=0, hi=MAX_TOP_LOGPROBS)
        _integer("logprob_start_len", self.logprob_start_len, lo=-1)
        self._validate_logit_bias(vocab_size)
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        for name in given:
            if not isinstance(getattr(self, name), str):
                raise InvalidParam(name, f"{name} must be a string, got {getattr(self, name)!r}")
        if len(given) > 1:
            raise InvalidParam(given[1], f"only one of json_schema, regex, ebnf and structural_tag may be given, "
                                         f"got {' and '.join(given)}")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, tuple) or any(not isinstance(p, tuple) or len(p) != 2
                                                          for p in self.logit_bias):
            raise InvalidParam("logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        hi = _INT32_MAX if vocab_size is None else vocab_size - 1
        for token, bias in self.logit_bias:
            if not _is_int(token) or not 0 <= token <= hi:
                raise InvalidParam("logit_bias", f"logit_bias keys must be token ids in [0, {hi}], got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                    or abs(bias) > MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"logit_bias values must be numbers in [-100, 100], "
                                                 f"got {bias!r} for token {token}")

    def _validate_token_ids(self, name: str, vocab_size: int | None) -> None:
        ids = getattr(self, name)
        if not isinstance(ids, tuple):
            raise InvalidParam(name, f"{name} must be a list of token ids, got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParam(name, f"{name} must hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
        hi = _INT32_MAX if vocab_size is None else vocab_size - 1
        for token in ids:
            if not _is_int(token) or not 0 <= token <= hi:
                raise InvalidParam(name, f"{name} must hold token ids in [0, {hi}], got {token!r}")


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
