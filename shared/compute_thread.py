"""ComputeThread: the one thread that does a worker's compute, from loading the model to every engine step.

OpenMP (torch's CPU thread pool, and oneDNN's) keeps one pool of helper threads per thread that opens a
parallel region. A model loaded on the main thread and stepped on an engine thread leaves two pools, more
OpenMP threads than cores, and libgomp then stops spinning between parallel regions: its helpers sleep and
are woken for every matmul and attention call. Measured on the default model, 2 threads: a batch-1 decode
step took 45 ms on a second thread against 23-24 ms on the thread that had loaded the model. So the worker
builds its model on this thread, and the engine loop then runs on it too.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "engine") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._loop: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn` on the thread and return its result (its exception is raised here)."""
        fut: Future = Future()
        self._tasks.put((fn, fut))
        return fut.result(timeout)

    def hand_over(self, loop: Callable[[], None]) -> None:
        """Let the thread run `loop` until it returns; nothing else runs on it afterwards."""
        self._loop = loop
        self._tasks.put(None)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                break
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller of run()
                    fut.set_exception(exc)
        if self._loop is not None:
            self._loop()
