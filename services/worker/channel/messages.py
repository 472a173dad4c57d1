"""What crosses the engine channel, each kind declared once: the front's calls, the engine's events, and the
record of one output.

A call is a dataclass whose fields are its arguments: the front sends `link.call(Prefill(...))`, the engine
runs the one handler declared for that type (`handles(Prefill)`), so the two are one symbol apart. On the wire a
call travels as its type's name and a map of its fields (`to_wire`), and is rebuilt by `call_from_wire`, which
knows only the types declared here: an unknown name, a missing or an extra field is refused there, before any
handler sees it. An event is declared and carried the same way, engine -> front.

Arguments are plain data (msgpack): a generation's sampling parameters travel as the serialized
`pb.SamplingParams` the gRPC call brought, so that they are converted from the wire once per worker, in the
engine process where they are used (`engine_calls.params_of`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from pdserve.shared.outputs import ReqOutput, TokenLogprobs


KNOWN: dict[str, dict[str, type]] = {"call": {}, "event": {}}  # kind -> type name -> the type


class Message:
    """A call or an event: its fields are what crosses."""

    kind: ClassVar[str] = ""

    def to_wire(self) -> tuple[str, dict]:
        return type(self).__name__, dict(self.__dict__)


def declared(cls: type) -> type:
    """A dataclass message, known by its name from now on."""
    cls = dataclass(cls)
    KNOWN[cls.kind][cls.__name__] = cls
    return cls


def from_wire(kind: str, name: Any, values: Any) -> Message:
    """The `kind` message `name` with `values`; ValueError (what is wrong) for anything else."""
    cls = KNOWN[kind].get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown {kind} {name!r:.80}")
    if not isinstance(values, dict):
        raise ValueError(f"the arguments of {name!r} are no map: {values!r:.80}")
    try:
        return cls(**values)
    except TypeError as exc:  # a field missing, or one it does not have
        raise ValueError(f"{name}: {exc}") from None


class Call(Message):
    kind = "call"


class Event(Message):
    kind = "event"


# ------------------------------------------------------------ generations (every generative role)
@declared
class Generate(Call):
    """Start a generation; its outputs come with the engine's steps. Decode workers' reserve their pages and tell
    the front (`PagesReserved`)."""
    rid: str
    input_ids: list[int]
    sampling: bytes  # a serialized pb.SamplingParams
    arrival: float
    lora: str = ""
    traced: bool = False
    resume: list | None = None  # [(choice index, its output so far)]: a migrated generation (shared/resume.py)
    kv_source: bool = False  # a live move: the KV of prompt and resumed output is written here, not computed


@declared
class Abort(Call):
    """Drop these requests (the rids found); `error`: what their streams end with."""
    rids: list[str]
    error: str | None = None


@declared
class Trace(Call):
    """A finished traced generation's record, for the front's span (spans.ReqTrace), or None."""
    rid: str


@declared
class Stop(Call):
    pass


# ------------------------------------------------------------ decode: the KV a prefill worker writes
@declared
class TransferMetadata(Call):
    """This worker's KV transfer agent's metadata (bytes), which registration hands the prefill workers."""


@declared
class KVAnswered(Call):
    """The prefill worker answered after its last write: close the window, take the first tokens; returns when
    the window closed (monotonic)."""
    rid: str
    pages: list[int]
    firsts: list  # [(token id, logprobs on the wire | None)]
    cached_tokens: int


@declared
class KVSettle(Call):
    """The reservation's fence is settled: an aborted request's pages go back to the pool."""
    rid: str
    pages: list[int]
    closed: bool
    lease_expired: bool = False


# ------------------------------------------------------------ decode: live moves out (shared/roles/move_out.py)
@declared
class Freeze(Call):
    """Freeze generations at their next step boundary, to continue elsewhere: `rids`, or all, or the `count`
    latest; (rids marked, "<rid>: <why>" refused)."""
    rids: list[str]
    all: bool
    count: int
    reason: str


@declared
class MoveOut(Call):
    """Write frozen `source_rid`'s KV into a decode worker's reserved pages, then free it here; answered as
    Prefill is, its first token the one held back."""
    source_rid: str
    token_ids: list[int]
    peer_name: str
    dst_pages: list[int]
    fence: int = 0
    fence_deadline: float = float("inf")


# ------------------------------------------------------------ prefill: filling a decode worker's pages
@declared
class Prefill(Call):
    """Prefill a prompt into a decode worker's pages; answered (`Prefilled`'s fields) after the last write."""
    rid: str
    input_ids: list[int]
    sampling: bytes
    arrival: float
    peer_name: str
    dst_pages: list[int]
    lora: str = ""
    lora_version: str = ""
    weights_version: str = ""
    traced: bool = False
    fence: int = 0
    fence_deadline: float = float("inf")


@declared
class Fence(Call):
    """Revoke a reservation's fence, then drop its request: {"fenced": bool, "error": str}."""
    rid: str
    peer_name: str
    fence: int


@declared
class AddPeer(Call):
    """Connect a registering decode worker: (whether it was known, this worker's metadata)."""
    name: str
    metadata: bytes


@declared
class RemovePeer(Call):
    name: str


# ------------------------------------------------------------ pooling
@declared
class Encode(Call):
    """Scores (with label tokens) or embeddings of each sequence."""
    seqs: list[list[int]]
    labels: list[int]


# ------------------------------------------------------------ operators
@declared
class Load(Call):
    pass


@declared
class FlushCache(Call):
    tiers: list[str] = field(default_factory=list)


@declared
class PoolStats(Call):
    pass


@declared
class StatsSample(Call):
    """(load, prefill tokens, decode tokens, speculation figures | None): running totals for the stats line."""


@declared
class Metrics(Call):
    """The engine's Prometheus exposition (bytes)."""


@declared
class Adapters(Call):
    pass


@declared
class LoadAdapter(Call):
    name: str
    path: str


@declared
class UnloadAdapter(Call):
    name: str


@declared
class Experts(Call):
    op: str  # start | stop | dump


@declared
class Weights(Call):
    """One step of a live weight update: prepare | commit | discard | served."""
    step: str
    path: str = ""
    number: int = 0
    tag: str = ""
    abort_reason: str | None = None


@declared
class SwitchRole(Call):
    """Turn the engine into `role` once it holds no request (waiting up to `wait_s`); the engine's info after."""
    role: str
    wait_s: float


# ------------------------------------------------------------ events, engine -> front
@declared
class PagesReserved(Event):
    """Decode: the engine reserved `pages` for `rid` and opened their window under `fence`; `checked`: every write
    into them passes the receiver's check (TCP's socket), so closing the window settles the fence."""
    rid: str
    pages: list[int]
    lora_version: str
    fence: int
    checked: bool


@declared
class CacheChanged(Event):
    """What the prefix cache gained and lost since the last step (shared/kv_events.CacheEvents.drain)."""
    cleared: list[str]
    added: dict
    removed: dict


@declared
class CacheDomain(Event):
    """The weights' digest the stored pages' keys are under, before any page stored under it."""
    domain: str


@declared
class TransferHealth(Event):
    ok: bool


# ------------------------------------------------------------ outputs
class OutputRecord(NamedTuple):
    """One ReqOutput as it crosses (a NamedTuple packs as a plain array: no field names per token). Its fields,
    in this order, are the wire's; `output` reads a record back by the same names."""
    rid: str
    index: int
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    matched_stop_token: int | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None
    input_logprobs: list | None
    queue_s: float
    compute_s: float
    first_token_time: float | None
    arrival: float | None
    tier_tokens: dict

    @classmethod
    def of(cls, o: ReqOutput) -> OutputRecord:
        return _tuple(cls, (o.rid, o.index, o.token_ids, _logprobs(o.logprobs), o.finish_reason,
                            o.matched_stop_token, o.prompt_tokens, o.cached_tokens, o.error,
                            _logprobs(o.input_logprobs), o.queue_s, o.compute_s, o.first_token_time, o.arrival,
                            o.tier_tokens))

    @staticmethod
    def output(record) -> ReqOutput:
        """The ReqOutput of a record as it arrived (a list in the record's order)."""
        (rid, index, token_ids, logprobs, finish_reason, matched_stop_token, prompt_tokens, cached_tokens, error,
         input_logprobs, queue_s, compute_s, first_token_time, arrival, tier_tokens) = record
        return ReqOutput(rid, index, list(token_ids), _from_logprobs(logprobs), finish_reason, matched_stop_token,
                         prompt_tokens, cached_tokens, error, _from_logprobs(input_logprobs), queue_s, compute_s,
                         first_token_time, arrival, dict(tier_tokens))


_tuple = tuple.__new__  # a record built without the generated __new__'s keyword handling: it runs per token


def _logprobs(lps: list[TokenLogprobs] | None) -> list | None:
    return None if lps is None else [lp.to_wire() for lp in lps]


def _from_logprobs(items: list | None) -> list[TokenLogprobs] | None:
    return None if items is None else [TokenLogprobs.from_wire(lp) for lp in items]
