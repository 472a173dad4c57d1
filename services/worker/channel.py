"""The local channel between a worker's front process and its engine process, and what crosses it.

Two ZMQ PUSH/PULL pipes (one each way) over Unix sockets in a directory of its own, mode 0700, so that only the
worker's user can reach them; the front binds, the engine connects, and the front removes the directory as soon
as the engine said it is ready: from then on no socket file exists, whatever kills either process later.

A frame is one msgpack list whose first item names its kind. Either side refuses a frame that is larger than
`MAX_FRAME_BYTES`, not msgpack, or of a kind it does not know: logged and dropped, never raised (a bug, or
another process of the same user, must not bring the worker down).

Front -> engine: ("start", command, args) once, then ("batch", [("call", id, name, kwargs) | ("cast", name,
kwargs), ...]): every call the front's event loop made in one turn, in one frame.
Engine -> front: ("ready", info) or ("failed", message) once; ("reply", id, ok, value | (kind, message)); and
one ("step", outputs, events) per engine loop iteration that produced any: every output of that step.
"""
from __future__ import annotations

import logging
from pathlib import Path

import msgpack

from pdserve.shared.outputs import ReqOutput, TokenLogprobs

log = logging.getLogger(__name__)

CHANNEL_ENV = "PDSERVE_ENGINE_CHANNEL"  # the channel's directory, handed to the engine process
MAX_FRAME_BYTES = 512 << 20  # a 64 MiB gRPC message's prompt as msgpack ints, with room to spare
TO_ENGINE, TO_FRONT = "to-engine", "to-front"  # socket file names in the directory


def address(directory: str | Path, name: str) -> str:
    return f"ipc://{Path(directory) / name}"


def pack(message: list | tuple) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes, kinds: frozenset[str], side: str) -> list | None:
    """The message in `frame`, or None (logged) when it is too large, malformed or of an unknown kind."""
    if len(frame) > MAX_FRAME_BYTES:
        log.error("%s: refused a %d-byte frame on the engine channel (limit %d)", side, len(frame), MAX_FRAME_BYTES)
        return None
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad data
        log.error("%s: refused a malformed frame on the engine channel: %r", side, exc)
        return None
    if not isinstance(message, list) or not message or message[0] not in kinds:
        log.error("%s: refused a frame of unknown kind on the engine channel: %.80r", side, message)
        return None
    return message


class RemoteError(Exception):
    """An engine-side call failed: `kind` says how (see `error_kind`), the message why, as the engine put it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def error_kind(exc: BaseException) -> str:
    """How a failure in the engine reaches the front, which answers by kind (rpc.CODES)."""
    from pdserve.shared.scoring import PoolBusy  # the engine's side only: these modules load torch
    from pdserve.shared.weights import CheckpointNotFound, WeightsError

    for kind, types in (("not_found", CheckpointNotFound), ("weights", WeightsError), ("busy", PoolBusy),
                        ("precondition", PermissionError), ("invalid", ValueError), ("timeout", TimeoutError),
                        ("unavailable", RuntimeError)):
        if isinstance(exc, types):
            return kind
    return "internal"


class EngineGone(RuntimeError):
    """The engine process exited: nothing sent to it will be answered."""


# ------------------------------------------------------------ outputs on the wire

def _logprobs(lps: list[TokenLogprobs] | None) -> list | None:
    return None if lps is None else [lp.to_wire() for lp in lps]


def _from_logprobs(items: list | None) -> list[TokenLogprobs] | None:
    return None if items is None else [TokenLogprobs.from_wire(lp) for lp in items]


def output_to_wire(o: ReqOutput) -> tuple:
    return (o.rid, o.index, o.token_ids, _logprobs(o.logprobs), o.finish_reason, o.matched_stop_token,
            o.prompt_tokens, o.cached_tokens, o.error, _logprobs(o.input_logprobs), o.queue_s, o.compute_s,
            o.first_token_time, o.arrival, o.tier_tokens)


def output_from_wire(item: list) -> ReqOutput:
    (rid, index, ids, lps, finish, matched, prompt, cached, error, input_lps, queue_s, compute_s, first,
     arrival, tier_tokens) = item
    return ReqOutput(rid, index, list(ids), _from_logprobs(lps), finish, matched, prompt, cached, error,
                     _from_logprobs(input_lps), queue_s, compute_s, first, arrival, dict(tier_tokens))
