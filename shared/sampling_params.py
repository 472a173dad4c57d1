"""SamplingParams: how one request wants its tokens chosen, with the checks that make a value acceptable.

A SamplingParams is immutable and built once per request: by the gateway from API values, or by a worker
from the gRPC message (`pdserve.proto.codec`, which derives the message from these fields). `validate` is the
single place where value ranges are decided; the gateway and the workers both call it, so a bad value is refused
with the same message wherever it enters. Ranges follow SGLang's sampling parameters and the OpenAI API.

Each field's definition holds all that is known about it: its type and default, and through `param` its range,
whether it is a penalty (and its neutral value), and whether a request using it can move to another worker pair
mid-stream. `validate`, `has_penalty` and the gateway's migration read those; none of them names a field.

Adding a parameter is three edits: its field here, declared with `param`; the same name in proto/worker.proto's
SamplingParams (the codec converts by name); and the sampler's code (a ban is a `Ban` in shared/sampler.py's
BANS, which speculative verification reads too; tests/shared/test_new_sampling_param.py adds a toy one). The gateway's API fields are generated from
these, under each API's names (services/gateway/intake/dialects.py). tests/shared/test_param_definitions.py fails
until the proto agrees, and shows a field declared in a subclass being validated, marked and reaching every API.
"""
from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NamedTuple

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
MAX_CACHE_SALT = 1024  # characters of a cache_salt (vLLM suggests 43: 256 random bits in base64)
# The grammar constraints; at most one per request (pdserve.shared.grammar compiles it).
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class InvalidParam(ValueError):
    """A sampling parameter outside its range; `field` is the SamplingParams attribute at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class FieldSpec:
    """What a field's definition says beyond its type and default (its type picks the kind of check)."""

    lo: float | None = None
    hi: float | None = None
    """The range validate() enforces; an integer without a bound is held to int32's, to fit the gRPC message."""
    lo_open: bool = False
    lo_text: str | None = None
    """How the refusal of a value below `lo` words the range, where the bound alone would mislead."""
    neutral: float | None = None
    """Set for a penalty: the value that changes nothing. has_penalty: some penalty away from its neutral value."""
    unmovable: str | None = None
    """Set where a request whose value is not the default cannot move to another worker pair mid-stream: the
    worker's state for it could not be rebuilt from the output so far, which is all a migration carries
    (shared/resume.py). Names those requests, as "requests with n > 1". No field is so marked today."""


_PLAIN = FieldSpec()


def param(default: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
          lo_text: str | None = None, penalty: float | None = None, unmovable: str | None = None) -> Any:
    """A SamplingParams field: its default, its range, and its marks (`penalty`: the neutral value)."""
    return field(default=default, metadata={"param": FieldSpec(lo, hi, lo_open, lo_text, penalty, unmovable)})


def spec_of(f: Any) -> FieldSpec:
    """The FieldSpec of a dataclass field (a field declared without `param` has no range and no marks)."""
    return f.metadata.get("param", _PLAIN)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = param(1.0, lo=0.0)
    """0 (or below 1e-6) is greedy decoding."""
    top_p: float = param(1.0, lo=0.0, hi=1.0, lo_open=True)
    """Keep the tokens whose more likely tokens hold less than top_p of the probability mass; (0, 1]."""
    top_k: int = param(-1, lo=-1, lo_text="-1 or 0 (no limit) or >= 1")
    """Keep the tokens with fewer than top_k more likely tokens; -1 or 0 means no limit."""
    min_p: float = param(0.0, lo=0.0, hi=1.0)
    """Keep the tokens at least min_p times as likely as the most likely one; [0, 1]."""
    frequency_penalty: float = param(0.0, lo=-2.0, hi=2.0, penalty=0.0)
    """Subtracted from a token's logit once per time it occurs in the output; [-2, 2]."""
    presence_penalty: float = param(0.0, lo=-2.0, hi=2.0, penalty=0.0)
    """Subtracted from the logit of every token present in the output; [-2, 2]."""
    repetition_penalty: float = param(1.0, lo=0.0, hi=2.0, lo_open=True, penalty=1.0)
    """Logits of tokens in the prompt or output: positive ones divided by it, negative ones multiplied; (0, 2]."""
    max_new_tokens: int = param(128, lo=0)
    """0 is allowed: the request ends at once with no tokens."""
    min_new_tokens: int = param(0, lo=0)
    """Until this many tokens are out, eos (unless ignore_eos) and stop_token_ids cannot be sampled."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these ends the request (finish reason "stop"), as eos does. The gateway drops an id past the
    vocabulary, which no step can sample (SGLang serves such a list, one written for a larger vocabulary)."""
    ignore_eos: bool = False
    """Eos does not end the request."""
    seed: int | None = param(None, lo=_INT64_MIN, hi=_INT64_MAX)
    """Same seed, params and model: the same tokens, whatever else runs in the batch."""
    n: int = param(1, lo=1, hi=MAX_N)
    """Number of choices sampled from one prompt; [1, 128]."""
    return_logprob: bool = False
    top_logprobs_num: int = param(0, lo=0, hi=MAX_TOP_LOGPROBS)
    """How many of the most likely tokens to report with each token's logprob; [0, 20]."""
    logprob_start_len: int = param(-1, lo=-1)
    """With return_logprob: report the logprobs of the prompt's tokens from this position on; -1: none."""
    token_ids_logprob: tuple[int, ...] = ()
    """With return_logprob: also report, at every position reported, the logprobs of these token ids."""
    logit_bias: tuple[tuple[int, float], ...] = param((), lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
    """(token id, bias) pairs, sorted: the bias is added to the token's logit before sampling; [-100, 100]."""
    json_schema: str | None = param(None)
    """Constrain the output to JSON matching this schema (a JSON string)."""
    regex: str | None = param(None)
    """Constrain the output to match this regular expression."""
    ebnf: str | None = param(None)
    """Constrain the output to this EBNF grammar (GBNF dialect, `root` rule first)."""
    structural_tag: str | None = param(None)
    """Constrain the parts of the output between begin/end tags (a JSON string, SGLang's structural_tag)."""
    think_start_ids: tuple[int, ...] = ()
    think_end_ids: tuple[int, ...] = ()
    """With a grammar and think_end_ids: the output may first reason, unconstrained, until think_end_ids; the
    grammar holds for what follows. With think_start_ids too, the reasoning happens only if the output opens
    with them (otherwise the grammar holds from the first token); without, the output starts in the reasoning."""
    cache_salt: str | None = param(None, lo=1, hi=MAX_CACHE_SALT)
    """Not a sampling choice but the prompt's cache namespace (vLLM's cache_salt): its KV is shared only with
    requests of the same salt, in the pool, the routers and every tier, so that one tenant cannot learn from cached
    token counts or timings what another sent. Carried here so that every path keeps it (PD, migration)."""

    def __post_init__(self) -> None:
        # Callers pass lists and dicts (JSON, proto fields); tuples keep the params hashable and comparable.
        table = _table(type(self))
        for name in table.token_lists:
            if not isinstance(getattr(self, name), tuple):
                try:
                    object.__setattr__(self, name, tuple(getattr(self, name)))
                except TypeError:
                    pass  # validate() names the field
        for name in table.token_maps:
            pairs = getattr(self, name)
            if isinstance(pairs, dict):
                pairs = pairs.items()
            if not isinstance(pairs, tuple) or any(not isinstance(pair, tuple) for pair in pairs):
                try:
                    object.__setattr__(self, name, tuple(sorted((k, v) for k, v in pairs)))
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

    @functools.cached_property
    def has_penalty(self) -> bool:
        """Whether some field marked as a penalty is away from its neutral value (asked for every row each step)."""
        return any(getattr(self, name) != neutral for name, neutral in _table(type(self)).penalties)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidParam naming the first field, in their order, outside its range (as its definition gives
        it; token ids are checked against vocab_size); then the rules across fields."""
        for check in _table(type(self)).checks:
            value = getattr(self, check.name)
            if not (check.optional and value is None):
                check.kind(check.name, value, check.spec, vocab_size)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidParam("min_new_tokens", f"min_new_tokens must be <= max_new_tokens "
                                                 f"({self.max_new_tokens}), got {self.min_new_tokens}")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidParam(given[1], f"only one of json_schema, regex, ebnf and structural_tag may be given, "
                                         f"got {' and '.join(given)}")


# ------------------------------------------------------------------ the checks, one per kind of field type
_Kind = Callable[[str, Any, FieldSpec, "int | None"], None]


class _Check(NamedTuple):
    name: str
    kind: _Kind
    spec: FieldSpec
    optional: bool  # None is a value (it means "not given")


class _Table(NamedTuple):
    """What a SamplingParams class's definitions ask of each instance, read once per class."""

    checks: tuple[_Check, ...]  # every field, in order
    token_lists: tuple[str, ...]  # normalised to tuples
    token_maps: tuple[str, ...]  # normalised to sorted (token, value) pairs
    penalties: tuple[tuple[str, float], ...]  # (field, neutral value)


@functools.cache
def _table(params: type) -> _Table:
    hints = typing.get_type_hints(params)
    checks = []
    for f in fields(params):
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        if optional:
            hint = next(a for a in args if a is not type(None))
        checks.append(_Check(f.name, _kind(f.name, hint), spec_of(f), optional))
    return _Table(tuple(checks), tuple(c.name for c in checks if c.kind is _token_ids),
                  tuple(c.name for c in checks if c.kind is _token_map),
                  tuple((c.name, c.spec.neutral) for c in checks if c.spec.neutral is not None))


def _kind(name: str, hint: Any) -> _Kind:
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]: token ids; tuple[tuple[int, V], ...]: token -> V
        return _token_map if typing.get_origin(typing.get_args(hint)[0]) is tuple else _token_ids
    kinds: dict[Any, _Kind] = {bool: _boolean, int: _integer, float: _number, str: _text}
    if hint not in kinds:
        raise TypeError(f"SamplingParams.{name}: no check for a field of type {hint}")
    return kinds[hint]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(name: str, value: object, spec: FieldSpec, vocab_size: int | None = None) -> None:
    """An integer in [lo, hi]; a missing bound is int32's, so that the value fits the gRPC message."""
    if not _is_int(value):
        raise InvalidParam(name, f"{name} must be an integer, got {value!r}")
    low = -_INT32_MAX - 1 if spec.lo is None else spec.lo
    high = _INT32_MAX if spec.hi is None else spec.hi
    _in_range(name, value, spec, low, high)


def _number(name: str, value: object, spec: FieldSpec, vocab_size: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParam(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParam(name, f"{name} must be a finite number, got {value}")
    _in_range(name, value, spec, spec.lo, spec.hi)


def _in_range(name: str, value: float, spec: FieldSpec, low: float | None, high: float | None) -> None:
    below = low is not None and (value <= low if spec.lo_open else value < low)
    above = high is not None and value > high
    if not (below or above):
        return
    if spec.lo is not None and spec.hi is not None:
        words = f"in {'(' if spec.lo_open else '['}{_fmt(spec.lo)}, {_fmt(spec.hi)}]"
    elif below:
        words = spec.lo_text or f"{'>' if spec.lo_open else '>='} {_fmt(low)}"
    else:
        words = f"<= {_fmt(high)}"
    raise InvalidParam(name, f"{name} must be {words}, got {value}")


def _boolean(name: str, value: object, spec: FieldSpec, vocab_size: int | None = None) -> None:
    if not isinstance(value, bool):
        raise InvalidParam(name, f"{name} must be true or false, got {value!r}")


def _text(name: str, value: object, spec: FieldSpec, vocab_size: int | None = None) -> None:
    """A string; of lo to hi characters where the definition gives them."""
    if not isinstance(value, str):
        raise InvalidParam(name, f"{name} must be a string, got {value!r}")
    if spec.lo is not None and spec.hi is not None and not spec.lo <= len(value) <= spec.hi:
        raise InvalidParam(name, f"{name} must be a string of {_fmt(spec.lo)} to {_fmt(spec.hi)} characters, "
                                 f"got {len(value)}")


def _token_ids(name: str, ids: object, spec: FieldSpec, vocab_size: int | None) -> None:
    if not isinstance(ids, tuple):
        raise InvalidParam(name, f"{name} must be a list of token ids, got {ids!r}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidParam(name, f"{name} must hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
    hi = _INT32_MAX if vocab_size is None else vocab_size - 1
    for token in ids:
        if not _is_int(token) or not 0 <= token <= hi:
            raise InvalidParam(name, f"{name} must hold token ids in [0, {hi}], got {token!r}")


def _token_map(name: str, pairs: object, spec: FieldSpec, vocab_size: int | None) -> None:
    """(token id, number) pairs, as logit_bias: the numbers in [lo, hi]."""
    if not isinstance(pairs, tuple) or any(not isinstance(p, tuple) or len(p) != 2 for p in pairs):
        raise InvalidParam(name, f"{name} must map token ids to numbers, got {pairs!r}")
    hi = _INT32_MAX if vocab_size is None else vocab_size - 1
    low = -math.inf if spec.lo is None else spec.lo
    high = math.inf if spec.hi is None else spec.hi
    for token, number in pairs:
        if not _is_int(token) or not 0 <= token <= hi:
            raise InvalidParam(name, f"{name} keys must be token ids in [0, {hi}], got {token!r}")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) \
                or not low <= number <= high:
            raise InvalidParam(name, f"{name} values must be numbers in [{_fmt(low)}, {_fmt(high)}], "
                                     f"got {number!r} for token {token}")


def _fmt(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)
