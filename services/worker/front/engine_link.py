"""EngineLink: a worker front's side of its engine process (started, called, watched) over the local channel.

`call(Prefill(...))` runs the engine's handler of that call type (`channel/messages.py`: each call a declared
type, its handler marked with it) and returns its result (RemoteError with the kind and message of a failure;
EngineGone once the process exited; TimeoutError past `timeout`). Calls made in one turn of the event loop leave
in one frame. A generation's outputs reach the sink registered for its rid (`watch`), all of one engine step's
in one delivery, and each event reaches the handler registered for its type (`on`).

Supervision: the link waits on the process; when it exits, every call in flight fails with EngineGone, every
watched generation gets an error output, and `on_exit` is told, so the front stops and its supervisor (`pdserve
up`, compose, Kubernetes) starts the worker again. The engine, for its part, exits when the front dies.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import sys
import tempfile
from typing import Callable

import zmq
import zmq.asyncio

from pdserve.services.worker.channel import wire
from pdserve.services.worker.channel.wire import EngineGone, RemoteError
from pdserve.services.worker.channel.messages import Call, Event, OutputRecord, Stop, from_wire
from pdserve.shared.outputs import ReqOutput

log = logging.getLogger("pdserve.worker")
ENGINE_KINDS = frozenset({"ready", "failed", "reply", "step"})
START_TIMEOUT_S = 1800.0  # loading and converting a large model, building its kernels, capturing graphs
STOP_TIMEOUT_S = 15.0
ENGINE_DIED = "the worker's engine process exited"

Sink = Callable[[list[ReqOutput]], None]


class EngineLink:
    def __init__(self, command: str, flags: dict, on_exit: Callable[[int], None] | None = None) -> None:
        self.command, self.flags = command, flags
        self.on_exit = on_exit
        self._on_event: dict[type, Callable] = {}  # event type -> its handler
        self.alive = False
        self.info: dict = {}
        self._sinks: dict[str, Sink] = {}
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._outbox: list[tuple] = []
        self._dir: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task] = []
        self._ready: asyncio.Future | None = None
        self._stopping = False

    # ------------------------------------------------------------ life
    async def start(self) -> dict:
        """Start the engine process and wait until it is ready: its info (engine_calls.info). ValueError with the
        engine's own message if it could not start."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._dir = tempfile.mkdtemp(prefix="pdserve-engine-")  # mode 0700: this user's only
        self._context = zmq.asyncio.Context(1)
        gate = wire.PeerGate(self._context, "front")  # the engine process only, once started
        self._to_engine = self._context.socket(zmq.PUSH)
        gate.guard(self._to_engine)
        self._to_engine.setsockopt(zmq.LINGER, 0)
        self._to_engine.bind(wire.address(self._dir, wire.TO_ENGINE))
        self._from_engine = self._context.socket(zmq.PULL)
        gate.guard(self._from_engine)
        self._from_engine.bind(wire.address(self._dir, wire.TO_FRONT))
        # A session of its own: a Ctrl-C at the terminal reaches the front alone, which drains, then stops it.
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdserve.services.worker.engine.engine_process", stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, wire.CHANNEL_ENV: self._dir}, start_new_session=True)
        gate.expect(self._proc.pid)
        self.alive = True
        self._tasks = [asyncio.create_task(self._read(), name="engine-channel"),
                       asyncio.create_task(self._watch(), name="engine-process")]
        self._to_engine.send(wire.pack(("start", self.command, self.flags))).add_done_callback(_sent)
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        finally:
            self._remove_dir()  # connected (or failed): no socket file needs to exist any more
        return self.info

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def stop(self) -> None:
        """Ask the engine to stop, wait for it (then kill it), and close the channel."""
        self._stopping = True
        if self._proc is not None and self._proc.returncode is None:
            if self.alive:
                self.cast(Stop())
                self._flush()
            try:
                await asyncio.wait_for(self._proc.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("the engine process did not stop in %g s: killing it", STOP_TIMEOUT_S)
                self._proc.kill()
                await self._proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._remove_dir()
        if hasattr(self, "_context"):
            self._to_engine.close(0)
            self._from_engine.close(0)
            self._context.term()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------ calls
    async def call(self, call: Call, timeout: float = 30.0):
        if not self.alive:
            raise EngineGone(ENGINE_DIED)
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        self._post(("call", call_id, *call.to_wire()))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(call_id, None)

    def cast(self, call: Call) -> None:
        """A call whose answer nobody waits for (an abort)."""
        if self.alive:
            self._post(("cast", *call.to_wire()))

    def on(self, event: type[Event], handler: Callable[[Event], None]) -> None:
        """`handler(e)` for each event `e` of this type the engine sends."""
        self._on_event[event] = handler

    def watch(self, rid: str, sink: Sink) -> None:
        self._sinks[rid] = sink

    def watched(self) -> list[str]:
        """The requests whose outputs are awaited now."""
        return list(self._sinks)

    def unwatch(self, rid: str) -> None:
        self._sinks.pop(rid, None)

    def _post(self, item: tuple) -> None:
        self._outbox.append(item)
        if len(self._outbox) == 1:  # one frame for whatever this turn of the loop sends
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if not items or not self.alive:
            return
        frames, too_large = wire.pack_batches(items)
        for frame in frames:
            self._to_engine.send(frame, copy=False).add_done_callback(_sent)
        for item in too_large:
            error = f"the call {item[-2]!r} is larger than the engine channel's frame limit " \
                    f"({wire.MAX_FRAME_BYTES} bytes)"
            future = self._pending.get(item[1]) if item[0] == "call" else None
            if future is not None and not future.done():
                future.set_exception(RemoteError("invalid", error))
            else:
                log.error("front: %s: not sent", error)

    # ------------------------------------------------------------ what comes back
    async def _read(self) -> None:
        while True:
            message = wire.unpack(await self._from_engine.recv(copy=True), ENGINE_KINDS, "front")
            if message is None:
                continue
            try:
                self._take(message)
            except Exception:  # one bad message must not end the channel
                log.exception("front: could not handle a %s message from the engine", message[0])

    def _take(self, message: list) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, events = message
            by_rid: dict[str, list[ReqOutput]] = {}
            for item in outputs:
                out = OutputRecord.output(item)
                by_rid.setdefault(out.rid, []).append(out)
            for rid, outs in by_rid.items():
                sink = self._sinks.get(rid)
                if sink is not None:
                    sink(outs)
            for name, values in events:
                event = from_wire("event", name, values)
                handler = self._on_event.get(type(event))
                if handler is not None:
                    handler(event)
        elif kind == "reply":
            _, call_id, ok, value = message
            future = self._pending.get(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RemoteError(*value))
        elif kind == "ready" and not self._ready.done():
            self._ready.set_result(message[1])
        elif kind == "failed" and not self._ready.done():
            self._ready.set_exception(ValueError(message[1]))

    async def _watch(self) -> None:
        code = await self._proc.wait()
        self.alive = False
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineGone(f"{ENGINE_DIED} while starting (exit code {code})"))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineGone(ENGINE_DIED))
        error = f"{ENGINE_DIED} (exit code {code}): the worker restarts"
        for rid, sink in list(self._sinks.items()):
            sink([ReqOutput(rid, 0, [], [], "abort", error=error)])
        if self.on_exit is not None and self.info and not self._stopping:
            self.on_exit(code)


def _sent(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:  # the process is going: `_watch` says so
        log.error("cannot send to the engine process: %s", future.exception())
