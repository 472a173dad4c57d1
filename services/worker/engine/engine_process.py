"""A generative worker's engine process: the device, the model, the KV pool, the scheduler, the step loop and the
KV transfer agent, and nothing of gRPC, protobuf or asyncio, so that the front's work never takes the
interpreter lock from a step.

Started by the front (`engine_link.EngineLink`) with the channel's directory in its environment; it reads its
flags from the first frame, builds everything, says ("ready", info) and serves the channel (`wire.py`):
- calls, each a declared type (`channel/messages.py`) run by the one handler marked for that type: the
  generations' and pooling's (`engine_calls.py`), the operators' (`engine_admin_calls.py`) and the role's own
  (`colocated_engine.py`, `prefill_engine.py`, `decode_engine.py`); each where it belongs: on the engine thread
  between steps (`engine.call`), or on a host thread when it would block (compiling a grammar, connecting a peer,
  closing a transfer window, reading a checkpoint), its reply sent when it is done;
- every output and event of one engine loop iteration in one ("step", ...) frame (`_flush`, the engine's
  `on_iteration` hook), so the front wakes once per step, not once per request.
A frame that is not a batch of calls, or a call it cannot take, is logged and dropped: no frame ends it.
It exits when the front says stop, when the front dies (the kernel's parent-death signal, and its parent id
checked every second), when the channel lost its connection (which cannot come back once its directory is gone),
when a tensor-parallel rank or node is gone (checked every second too), or on SIGTERM/SIGINT.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import Future

import zmq

from pdserve.services.worker.channel import wire
from pdserve.services.worker.engine.colocated_engine import ColocatedEngine
from pdserve.services.worker.engine.decode_engine import DecodeEngine
from pdserve.services.worker.engine.engine_admin_calls import AdminCalls
from pdserve.services.worker.engine.engine_calls import GenerationCalls
from pdserve.services.worker.channel.messages import Call, OutputRecord, from_wire
from pdserve.services.worker.engine.engine_worker import WorkerEngine, handlers_of
from pdserve.services.worker.engine.prefill_engine import PrefillEngine
from pdserve.shared.config import Role
from pdserve.shared.logs import setup_logging

log = logging.getLogger("pdserve.worker")
FRONT_KINDS = frozenset({"start", "batch"})
START_TIMEOUT_S = 30.0  # for the front's first frame, once connected


class Pipe:
    """The engine's ends of the channel: a PULL socket read by the main thread, a PUSH socket that any thread
    writes to under a lock (ZMQ sockets are not thread-safe)."""

    def __init__(self, directory: str) -> None:
        self.context = zmq.Context(1)
        self.gate = wire.PeerGate(self.context, "engine", os.getppid())  # the front that started it, only
        self.inbox = self.context.socket(zmq.PULL)
        self.gate.guard(self.inbox)
        self.inbox.connect(wire.address(directory, wire.TO_ENGINE))
        self.outbox = self.context.socket(zmq.PUSH)
        self.gate.guard(self.outbox)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(wire.address(directory, wire.TO_FRONT))
        self._lock = threading.Lock()
        # Once the directory is gone a lost connection cannot come back (ZMQ drops one whose peer sent a frame over
        # `maxmsgsize`, and never connects again): a worker that can no longer hear or answer its front ends.
        self._monitors = [s.get_monitor_socket(zmq.EVENT_DISCONNECTED) for s in (self.inbox, self.outbox)]

    def broken(self) -> bool:
        """Whether either pipe lost its connection since the last call."""
        lost = False
        for monitor in self._monitors:
            while monitor.poll(0):
                monitor.recv_multipart()
                lost = True
        return lost

    def send(self, message: list | tuple) -> bool:
        """False (logged) when the message is too large for a frame: nothing was sent."""
        frame = wire.pack(message)
        if len(frame) > wire.MAX_FRAME_BYTES:
            log.error("engine: a %s message of %d bytes is over the channel's frame limit (%d): not sent",
                      message[0], len(frame), wire.MAX_FRAME_BYTES)
            return False
        with self._lock:
            self.outbox.send(frame, copy=False)
        return True

    def recv(self, timeout_s: float) -> list | None:
        if not self.inbox.poll(int(timeout_s * 1000)):
            return None
        return wire.unpack(self.inbox.recv(copy=True), FRONT_KINDS, "engine")

    def close(self) -> None:
        for sock, monitor in zip((self.inbox, self.outbox), self._monitors):
            sock.disable_monitor()
            monitor.close(0)
        self.inbox.close(0)
        self.outbox.close()
        self.context.term()


def engine_role(role: Role) -> type[ColocatedEngine]:
    """The engine side of a role: what it adds to the engine, and the calls only it serves."""
    return {side.role: side for side in (ColocatedEngine, PrefillEngine, DecodeEngine)}[role]


class EngineHost:
    """Serves the channel over one worker's engine: every call to the handler of its type."""

    def __init__(self, command: str, args: argparse.Namespace, pipe: Pipe) -> None:
        self.pipe = pipe
        self.failed = False
        self.worker = w = WorkerEngine(engine_role(Role(command)), args)
        # The calls every role serves; after a live role switch, the new role's own (AdminCalls.switch_role).
        self._common = (GenerationCalls(w), AdminCalls(w, engine_role, self._serve_role))
        self._serve_role()
        w.engine.on_iteration = self._flush

    def _serve_role(self) -> None:
        self.handlers = handlers_of(*self._common, self.worker.role)

    # ------------------------------------------------------------ engine thread
    def _flush(self) -> None:
        outputs, events = self.worker.take_step()
        if not outputs and not events:
            return
        wire_events = [e.to_wire() for e in events]
        if not self.pipe.send(("step", outputs, wire_events)):  # one frame per output, then
            self.pipe.send(("step", [], wire_events))
            for out in outputs:
                if not self.pipe.send(("step", [out], [])):
                    error = "the output is larger than the engine channel's frame limit"
                    self.pipe.send(("step", [OutputRecord(out.rid, out.index, [], [], "abort", None, 0, 0, error,
                                                          None, 0.0, 0.0, None, None, {})], []))

    # ------------------------------------------------------------ the channel (main thread)
    def serve(self, stop: Stop) -> None:
        w = self.worker
        w.engine.start(w.compute)
        self.pipe.broken()  # what happened while connecting, when the front could still connect again
        self.pipe.send(("ready", w.info()))
        parent = os.getppid()
        while not stop.asked:
            message = self.pipe.recv(1.0)
            if os.getppid() != parent:
                log.error("the worker's front process is gone: the engine process exits")
                break
            if self.pipe.broken():
                log.error("the engine channel lost its connection to the front (a frame over its limit, or the "
                          "front going): the engine process exits, for the worker to start again")
                self.failed = True
                break
            if not w.engine.is_alive() or not w.ranks_alive():  # a lost tensor-parallel rank
                self.failed = True
                break
            for item in _calls(message):
                self._dispatch(item)
            if stop.asked or w.stop_asked:
                break
        w.shutdown()

    def _dispatch(self, item) -> None:
        try:
            if not isinstance(item, list) or not item:
                raise ValueError(f"not a call: {item!r:.80}")
            kind, rest = item[0], item[1:]
            if kind == "call":
                call_id, name, values = rest
            elif kind == "cast":
                call_id, (name, values) = None, rest
            else:
                raise ValueError(f"unknown item kind {kind!r}")
            call = from_wire("call", name, values)
            handler = self.handlers.get(type(call))
            if handler is None:
                raise ValueError(f"this {self.worker.role.role.value} worker serves no {name} call")
        except (ValueError, TypeError, IndexError) as exc:
            log.error("engine: refused an item on the engine channel: %s", exc)
            return
        self._run(call_id, call, handler)

    def _run(self, call_id, call: Call, handler) -> None:
        where = handler.where
        if where == "engine":
            future = self.worker.engine.call(lambda: handler(call))
        elif where == "thread":
            future = self.worker.threads.submit(handler, call)
        else:  # "here": cheap and thread-safe
            future = Future()
            try:
                future.set_result(handler(call))
            except Exception as exc:
                future.set_exception(exc)
        name = type(call).__name__
        future.add_done_callback(lambda f: self._reply(call_id, name, f))

    def _reply(self, call_id, name: str, future: Future) -> None:
        try:
            value = future.result()
        except Exception as exc:
            if call_id is None or wire.error_kind(exc) == "internal":
                log.warning("engine call %s failed: %r", name, exc, exc_info=wire.error_kind(exc) == "internal")
            if call_id is not None:
                self.pipe.send(("reply", call_id, False, (wire.error_kind(exc), str(exc))))
            return
        if isinstance(value, Future):  # a call answered when its request is done (a prefill)
            value.add_done_callback(lambda f: self._reply(call_id, name, f))
        elif call_id is not None and not self.pipe.send(("reply", call_id, True, value)):
            self.pipe.send(("reply", call_id, False, ("internal", f"the answer to {name} is larger than the engine "
                                                                   "channel's frame limit")))


def _calls(message: list | None) -> list:
    """The calls of a ("batch", [call, ...]) frame; none (logged) from any other frame."""
    if message is None:
        return []
    if message[0] != "batch" or len(message) != 2 or not isinstance(message[1], list):
        log.error("engine: refused a frame on the engine channel that is no batch of calls: %.80r", message)
        return []
    return message[1]


def _die_with_parent() -> None:
    """SIGTERM when the front dies (Linux), so the engine never outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # the parent id check in `serve` still ends it within a second


class Stop:
    """Set by SIGTERM/SIGINT (the front's death among them). A plain flag: a handler that took a lock could
    deadlock against the code it interrupted, which may hold that very lock; while the engine is still being
    built, there is nothing to wind down and the process exits at once."""

    def __init__(self) -> None:
        self.asked = False
        self.serving = False

    def __call__(self, signum, frame) -> None:
        if not self.serving:
            _remove_channel_dir()
            os._exit(1)
        self.asked = True


def _remove_channel_dir() -> None:
    """The front removes the channel's directory once the engine is ready; an engine that ends before (its
    front died meanwhile, or it could not start) removes it itself."""
    shutil.rmtree(os.environ.get(wire.CHANNEL_ENV, ""), ignore_errors=True)


def _start(message: list | None) -> tuple[str, argparse.Namespace] | None:
    """The command and flags of a ("start", command, flags) frame; None (logged) from any other frame."""
    if message is None:
        return None
    if message[0] != "start" or len(message) != 3 or not isinstance(message[1], str) \
            or not isinstance(message[2], dict) or not all(isinstance(k, str) for k in message[2]):
        log.error("engine: refused a frame on the engine channel that is no start frame: %.80r", message)
        return None
    return message[1], argparse.Namespace(**message[2])


def main() -> int:
    _die_with_parent()
    stop = Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    pipe = Pipe(os.environ[wire.CHANNEL_ENV])
    started = time.monotonic()
    start = None
    while start is None and time.monotonic() - started < START_TIMEOUT_S:
        start = _start(pipe.recv(1.0))
    if start is None:
        print("error: the worker's front process sent no start frame", file=sys.stderr)
        pipe.close()
        return 1
    command, args = start
    setup_logging(args.log_level, args.log_format == "json")
    try:
        host = EngineHost(command, args, pipe)
    except (ValueError, OSError, RuntimeError) as exc:
        pipe.send(("failed", str(exc)))
        pipe.close()
        _remove_channel_dir()
        return 1
    stop.serving = True
    host.serve(stop)
    pipe.close()
    return 1 if host.failed else 0


if __name__ == "__main__":
    sys.exit(main())
