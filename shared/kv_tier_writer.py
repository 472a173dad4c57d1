"""TierWriter: the storage tier's writer thread (kv_tiers.py decides what to write; this writes it, off the step).

A job (`Write`) names its pages in a buffer: the pool's (their path locked in the radix cache until written), the
host tier's (its slots lent until written) or a copy's. At most a quarter of the pool waits to be written: a job
that would go past that is dropped and counted, never queued without bound. What was written is reported back
through `written`, which runs on the writer thread: the tiers hand it to their engine thread.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from pdserve.shared.kv_files import KVFiles
    from pdserve.shared.radix_cache import Node

WRITE_RUN = 64  # pages written at once (KVFiles.write_run); a job of more is written a run at a time


@dataclass
class Write:
    """Pages for the writer: `buffer[pages[i]]` is keys[i]'s page, read once `ready` (a CUDA event) is."""

    keys: list[str]
    buffer: torch.Tensor
    pages: list[int]
    nodes: list[Node]
    locked: Node | None = None  # the node whose path is locked in the cache until written
    ready: torch.cuda.Event | None = None
    lent: bool = False  # `pages` are host slots to give back when written


class TierWriter:
    def __init__(self, files: KVFiles, limit_pages: int, written: Callable[[Write, list[bool]], None]) -> None:
        self.files = files
        self.limit_pages = max(1, limit_pages)
        self.pending_pages = 0  # asked for and not yet reported written (engine thread)
        self.dropped = 0  # pages not written because the writer was `limit_pages` behind
        self._written = written
        self._jobs: queue.Queue[Write] = queue.Queue()
        threading.Thread(target=self._loop, name="kv-tier-write", daemon=True).start()

    def room(self, pages: int) -> bool:
        """Engine thread: whether a job of `pages` may be queued (then counted as pending until `landed`)."""
        if self.pending_pages + pages > self.limit_pages:
            self.dropped += pages
            return False
        self.pending_pages += pages
        return True

    def put(self, write: Write) -> None:
        self._jobs.put(write)

    def landed(self, write: Write) -> None:
        """Engine thread: `write` is done (with `written`'s report)."""
        self.pending_pages -= len(write.keys)

    def _loop(self) -> None:
        while True:
            write = self._jobs.get()
            if write.ready is not None:
                write.ready.synchronize()  # the copies into host memory have run
            ok: list[bool] = []
            for start in range(0, len(write.keys), WRITE_RUN):
                run = write.pages[start:start + WRITE_RUN]
                ok += self.files.write_run(write.keys[start:start + WRITE_RUN],
                                           [write.buffer[p].cpu().reshape(-1).view(torch.uint8).numpy().data
                                            for p in run])
            self._written(write, ok)
