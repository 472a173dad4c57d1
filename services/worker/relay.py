"""OutputRelay: carries request outputs from the engine thread to the event loop, one wake-up per batch.

The engine emits one output per running request per step. Waking the event loop once per output
(`call_soon_threadsafe` writes to its self-pipe each time) costs a syscall and a loop iteration per token, and
every such hop competes with the engine for the GIL; the relay collects what a step emitted and wakes the loop
once, which then hands each output to its request's queue.
"""
from __future__ import annotations

import asyncio
import threading
from typing import TypeVar

T = TypeVar("T")


class OutputRelay:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def send(self, queue: asyncio.Queue[T], item: T) -> None:
        """From any thread: `queue.put_nowait(item)` on the loop, soon, in the order sent."""
        with self._lock:
            self._pending.append((queue, item))
            wake = len(self._pending) == 1
        if wake:
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for queue, item in items:
            queue.put_nowait(item)
        # A StepSink turns what it got into one message now: once per delivery, after all of its outputs.
        for sink in {id(queue): queue for queue, _ in items if hasattr(queue, "flush")}.values():
            sink.flush()
