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
It exits when the front says stop, when the front dies (the kernel's parent-death signal, and its parent id
checked every second), when a tensor-parallel rank or node is gone (checked every second too), or on
SIGTERM/SIGINT.
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

log = logging.getLogger("pdserve.worker")
FRONT_KINDS = frozenset({"start", "batch"})
START_TIMEOUT_S = 30.0  # for the front's first frame, once connected


class Pipe:
    """The engine's ends of the channel: a PULL socket read by the main thread, a PUSH socket that any thread
    writes to under a lock (ZMQ sockets are not thread-safe)."""

    def __init__(self, directory: str) -> None:
        self.context = zmq.Context(1)
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.connect(channel.address(directory, channel.TO_ENGINE))
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(channel.address(directory, channel.TO_FRONT))
        self._lock = threading.Lock()

    def send(self, message: list | tuple) -> None:
        frame = channel.pack(message)
        with self._lock:
            self.outbox.send(frame, copy=False)

    def recv(self, timeout_s: float) -> list | None:
        if not self.inbox.poll(int(timeout_s * 1000)):
            return None
        return channel.unpack(self.inbox.recv(copy=True), FRONT_KINDS, "engine")

    def close(self) -> None:
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
            self.pipe.send(("step", outputs, events))

    # ------------------------------------------------------------ the channel (main thread)
    def serve(self, stop: Stop) -> None:
        self.engine.start(self.compute)
        self.pipe.send(("ready", self.info()))
        parent = os.getppid()
        while not stop.asked:
            message = self.pipe.recv(1.0)
            if os.getppid() != parent:
                log.error("the worker's front process is gone: the engine process exits")
                break
            if not self.engine.is_alive() or not self._ranks_alive():  # a lost tensor-parallel rank
                self.failed = True
                break
            if message is None or message[0] != "batch":
                continue
            for item in message[1]:
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
            kind, rest = item[0], item[1:]
            if kind == "call":
                call_id, name, kwargs = rest
            elif kind == "cast":
                call_id, (name, kwargs) = None, rest
            else:
                raise ValueError(f"unknown item kind {kind!r}")
            handler = getattr(self, f"call_{name}", None)
            if handler is None or not isinstance(kwargs, dict):
                raise ValueError(f"unknown call {name!r}")
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
        elif call_id is not None:
            self.pipe.send(("reply", call_id, True, value))


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


def main() -> int:
    _die_with_parent()
    stop = Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    pipe = Pipe(os.environ[channel.CHANNEL_ENV])
    started = time.monotonic()
    message = None
    while message is None and time.monotonic() - started < START_TIMEOUT_S:
        message = pipe.recv(1.0)
    if message is None or message[0] != "start":
        print("error: the worker's front process sent no start frame", file=sys.stderr)
        return 1
    _, command, flags = message
    args = argparse.Namespace(**flags)
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
