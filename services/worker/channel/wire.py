"""The local channel between a worker's front process and its engine process, and what crosses it.

Two ZMQ PUSH/PULL pipes (one each way) over Unix sockets in a directory of its own, mode 0700, so that only the
worker's user can reach them; the front binds, the engine connects, and the front removes the directory as soon
as the engine said it is ready: from then on no socket file exists, whatever kills either process later.

Each side admits one peer (`PeerGate`): the front its engine process, the engine its front (its parent), known
by the process id the kernel gives for a Unix socket's peer (SO_PEERCRED). Any other process of the same user that
reaches the directory meanwhile is refused at the handshake, logged, and never sees or sends a frame.

A frame is one msgpack list whose first item names its kind, at most `MAX_FRAME_BYTES`: ZMQ drops a peer that
sends more before any of it is kept (`maxmsgsize`), and each sender splits or refuses what would not fit, so its
peer never has to. A frame that is not msgpack, of a kind or shape the receiver does not know, is logged and
dropped, never raised (a bug must not bring the worker down).

Front -> engine: ("start", command, args) once, then ("batch", [("call", id, name, fields) | ("cast", name,
fields), ...]): every call the front's event loop made in one turn, in one frame; each call a type declared in
`channel/messages.py`, named with its fields.
Engine -> front: ("ready", info) or ("failed", message) once; ("reply", id, ok, value | (kind, message)); and
one ("step", outputs, events) per engine loop iteration that produced any: every output of that step (each an
`messages.OutputRecord`) and its events (each a declared type too, named with its fields).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import msgpack
import zmq

log = logging.getLogger(__name__)

CHANNEL_ENV = "PDSERVE_ENGINE_CHANNEL"  # the channel's directory, handed to the engine process
# The largest legitimate item is a prompt of a 64 MiB gRPC message (the worker's limit): packed varints of at least
# 3 bytes per token id become msgpack ints of at most 5, so at most ~107 MiB; twice that and some. A batch of
# several such calls is split across frames by the front (`pack_batches`), a larger reply refused by the engine.
MAX_FRAME_BYTES = 256 << 20
TO_ENGINE, TO_FRONT = "to-engine", "to-front"  # socket file names in the directory
ZAP_DOMAIN = b"pdserve-engine-channel"
GATE_WAIT_S = 10.0  # the front learns its engine's pid as it starts it: a handshake waits at most this for it


def address(directory: str | Path, name: str) -> str:
    return f"ipc://{Path(directory) / name}"


def pack(message: list | tuple) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def pack_batches(items: list) -> tuple[list[bytes], list]:
    """("batch", items) as frames of at most MAX_FRAME_BYTES each (consecutive items), and the items that would not
    fit in any frame alone."""
    whole = pack(("batch", items))
    if len(whole) <= MAX_FRAME_BYTES:  # nearly always: one frame, packed once
        return [whole], []
    packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack_array_header(2) + packer.pack("batch")
    frames, too_large, run, size = [], [], [], 0
    room = MAX_FRAME_BYTES - len(head) - 5  # 5: the largest array header

    def close_run() -> None:
        if run:
            frames.append(head + packer.pack_array_header(len(run)) + b"".join(run))
            run.clear()

    for item in items:
        packed = packer.pack(item)
        if len(packed) > room:
            too_large.append(item)
            continue
        if size + len(packed) > room:
            close_run()
            size = 0
        run.append(packed)
        size += len(packed)
    close_run()
    return frames, too_large


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


class PeerGate:
    """Admits to a ZMQ context's guarded sockets (`guard`) connections from one process only: ZMQ asks this gate
    (its ZAP handler, on a thread) about every connection, with the peer's uid, gid and pid from SO_PEERCRED,
    which libzmq puts in a Unix socket peer's address. Until `expect` names the process, a handshake waits (at
    most GATE_WAIT_S). Every other peer is refused and logged once."""

    def __init__(self, context: zmq.Context, side: str, pid: int | None = None) -> None:
        self.side = side
        self.pid = pid
        self._known = threading.Event()
        if pid is not None:
            self._known.set()
        self._refused: set[str] = set()
        self._socket = zmq.Context.shadow(context.underlying).socket(zmq.REP)  # a plain socket, for a plain thread
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind("inproc://zeromq.zap.01")
        threading.Thread(target=self._serve, name=f"{side}-channel-gate", daemon=True).start()

    def expect(self, pid: int) -> None:
        self.pid = pid
        self._known.set()

    @staticmethod
    def guard(socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)  # every connection asks the gate first
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)

    def admits(self, peer: str) -> bool:
        """Whether `peer` ("address:uid:gid:pid") is the expected process of this user."""
        self._known.wait(GATE_WAIT_S)
        try:
            uid, _, pid = (int(part) for part in peer.rsplit(":", 3)[1:])
        except ValueError:  # no credentials: not a Unix socket, or a kernel without SO_PEERCRED
            return False
        return uid == os.getuid() and pid == self.pid

    def _serve(self) -> None:
        while True:
            try:
                request = self._socket.recv_multipart()
            except zmq.ContextTerminated:
                self._socket.close()
                return
            peer = request[3].decode(errors="replace") if len(request) > 3 else ""
            ok = self.admits(peer)
            if not ok and peer not in self._refused:
                self._refused.add(peer)
                log.error("%s: refused a connection to the engine channel from %s (uid:gid:pid), not process %s",
                          self.side, peer, self.pid)
            request_id = request[1] if len(request) > 1 else b""
            self._socket.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                         b"OK" if ok else b"not this channel's peer", b"", b""])


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
