"""A generative worker's engine process: the device, the model, the KV pool, the scheduler, the step loop and the
KV transfer agent, and nothing of gRPC, protobuf or asyncio, so that the front's work never takes the
interpreter lock from a step.

Started by the front (`engine_link.EngineLink`) with the channel's directory in its environment; it reads its
flags from the first frame, builds everything, says ("ready", info) and serves the channel (`channel.py`):
- calls, by name (`EngineHost.call_*`), each run where it belongs: on the engine thread between steps
  (`engine.call`), or on a host thread when it would block (compiling a grammar, connecting a peer, closing a
  transfer window, reading a checkpoint), its reply sent when it is done;
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
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from pdserve.services.worker import channel
from pdserve.services.worker.engine_calls import EngineCalls
from pdserve.shared.kv_events import CacheEvents
from pdserve.shared.logs import setup_logging
from pdserve.shared.outputs import ReqOutput

log = logging.getLogger("pdserve.worker")
FRONT_KINDS = frozenset({"start", "batch"})
START_TIMEOUT_S = 30.0  # for the front's first frame, once connected


class Pipe:
    """The engine's ends of the channel: a PULL socket read by the main thread, a PUSH socket that any thread
    writes to under a lock (ZMQ sockets are not thread-safe)."""

    def __init__(self, directory: str) -> None:
        self.context = zmq.Context(1)
        self.gate = channel.PeerGate(self.context, "engine", os.getppid())  # the front that started it, only
        self.inbox = self.context.socket(zmq.PULL)
        self.gate.guard(self.inbox)
        self.inbox.connect(channel.address(directory, channel.TO_ENGINE))
        self.outbox = self.context.socket(zmq.PUSH)
        self.gate.guard(self.outbox)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(channel.address(directory, channel.TO_FRONT))
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
        frame = channel.pack(message)
        if len(frame) > channel.MAX_FRAME_BYTES:
            log.error("engine: a %s message of %d bytes is over the channel's frame limit (%d): not sent",
                      message[0], len(frame), channel.MAX_FRAME_BYTES)
            return False
        with self._lock:
            self.outbox.send(frame, copy=False)
        return True

    def recv(self, timeout_s: float) -> list | None:
        if not self.inbox.poll(int(timeout_s * 1000)):
            return None
        return channel.unpack(self.inbox.recv(copy=True), FRONT_KINDS, "engine")

    def close(self) -> None:
        for sock, monitor in zip((self.inbox, self.outbox), self._monitors):
            sock.disable_monitor()
            monitor.close(0)
        self.inbox.close(0)
        self.outbox.close()
        self.context.term()


class EngineHost(EngineCalls):
    """Serves the channel over one worker's engine (built by EngineCalls)."""

    def __init__(self, command: str, args: argparse.Namespace, pipe: Pipe) -> None:
        self.pipe = pipe
        self.threads = ThreadPoolExecutor(8, thread_name_prefix="engine-host")
        self._outputs: list[tuple] = []  # engine thread only: this iteration's outputs and events
        self._events: list[tuple] = []
        self._transfer_ok = True
        self.failed = False
        super().__init__(command, args)
        self.engine.on_iteration = self._flush
        # What the prefix cache gains and loses, told to the routers with each iteration's outputs.
        self.cache_events = self.engine.cache.events = CacheEvents()
        if self.engine.tiers is not None:
            self.engine.tiers.events = self.cache_events
        self._domain = ""

    # ------------------------------------------------------------ engine thread
    def emit(self, out) -> None:
        """A request's `on_output`: kept until the iteration ends."""
        self._outputs.append(channel.output_to_wire(out))

    def event(self, *event) -> None:
        self._events.append(event)

    def _flush(self) -> None:
        if self.transfer is not None and self.transfer.healthy() != self._transfer_ok:
            self._transfer_ok = not self._transfer_ok
            self._events.append(("transfer_healthy", self._transfer_ok))
        domain = self.engine.tiers.domain if self.engine.tiers is not None else ""
        if domain != self._domain:  # before the pages stored under it
            self._domain = domain
            self._events.append(("kv_domain", domain))
        kv = self.cache_events.drain()
        if kv is not None:
            self._events.append(kv)
        if self._outputs or self._events:
            outputs, events, self._outputs, self._events = self._outputs, self._events, [], []
            if not self.pipe.send(("step", outputs, events)):  # one frame per output, then
                self.pipe.send(("step", [], events))
                for out in outputs:
                    if not self.pipe.send(("step", [out], [])):
                        error = "the output is larger than the engine channel's frame limit"
                        self.pipe.send(("step", [channel.output_to_wire(
                            ReqOutput(out[0], out[1], [], [], "abort", error=error))], []))

    # ------------------------------------------------------------ the channel (main thread)
    def serve(self, stop: Stop) -> None:
        self.engine.start(self.compute)
        self.pipe.broken()  # what happened while connecting, when the front could still connect again
        self.pipe.send(("ready", self.info()))
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
            if not self.engine.is_alive() or not self._ranks_alive():  # a lost tensor-parallel rank
                self.failed = True
                break
            for item in _calls(message):
                self._dispatch(item)
            if stop.asked or self._stop_asked:
                break
        self.shutdown()

    def _ranks_alive(self) -> bool:
        """Whether every other rank (and node) of a tensor-parallel worker is still there: a step notices a lost
        one itself, this notices it while the worker is idle."""
        if self.ranks is None:
            return True
        from pdserve.shared.tp_group import RankGone

        try:
            self.ranks.check_alive()
        except RankGone as exc:
            log.error("%s: this worker stops, for its supervisor to start it again", exc)
            return False
        return True

    def _dispatch(self, item) -> None:
        try:
            if not isinstance(item, list) or not item:
                raise ValueError(f"not a call: {item!r:.80}")
            kind, rest = item[0], item[1:]
            if kind == "call":
                call_id, name, kwargs = rest
            elif kind == "cast":
                call_id, (name, kwargs) = None, rest
            else:
                raise ValueError(f"unknown item kind {kind!r}")
            handler = getattr(self, f"call_{name}", None)
            if handler is None:
                raise ValueError(f"unknown call {name!r}")
            if not isinstance(kwargs, dict):
                raise ValueError(f"the arguments of {name!r} are no map: {kwargs!r:.80}")
        except (ValueError, TypeError, IndexError) as exc:
            log.error("engine: refused an item on the engine channel: %s", exc)
            return
        self._run(call_id, name, handler, kwargs)

    def _run(self, call_id, name: str, handler, kwargs: dict) -> None:
        where = getattr(handler, "where", "engine")
        if where == "engine":
            future = self.engine.call(lambda: handler(**kwargs))
        elif where == "thread":
            future = self.threads.submit(handler, **kwargs)
        else:  # "here": cheap and thread-safe
            future = Future()
            try:
                future.set_result(handler(**kwargs))
            except Exception as exc:
                future.set_exception(exc)
        future.add_done_callback(lambda f: self._reply(call_id, name, f))

    def _reply(self, call_id, name: str, future: Future) -> None:
        try:
            value = future.result()
        except Exception as exc:
            if call_id is None or channel.error_kind(exc) == "internal":
                log.warning("engine call %s failed: %r", name, exc, exc_info=channel.error_kind(exc) == "internal")
            if call_id is not None:
                self.pipe.send(("reply", call_id, False, (channel.error_kind(exc), str(exc))))
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
    shutil.rmtree(os.environ.get(channel.CHANNEL_ENV, ""), ignore_errors=True)


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
    pipe = Pipe(os.environ[channel.CHANNEL_ENV])
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
