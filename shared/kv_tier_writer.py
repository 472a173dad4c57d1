"""TierWriter: the storage tier's writer thread (kv_tiers.py decides what to write; this writes it, off the step),
and PathWrites: the write_through policies' paths, in parts.

A job (`Write`) names its pages in a buffer: the pool's (their path locked in the radix cache until written), the
host tier's (its slots lent until written) or a copy's. At most `limit_pages` (a quarter of the pool) wait to be
written at once: `take` grants a job as many pages as that leaves room for, never more, so a job larger than the
limit is written in parts (the caller asks again for the rest as parts land, or drops it). Pages not written are
counted per reason (`dropped`), never queued without bound. What was written is reported back through `written`,
which runs on the writer thread: the tiers hand it to their engine thread.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from pdserve.shared.kv_files import KVFiles
    from pdserve.shared.radix_cache import Node, RadixCache

WRITE_RUN = 64  # pages written at once (KVFiles.write_run); a job of more is written a run at a time
# Why a page meant for storage was not written: `behind`: the pool evicted it (write_back) while `limit_pages`
# waited already, and an evicted page cannot wait; `evicted`: it waited its turn unlocked (past the part of its
# path being written) and the pool evicted it first.
DROP_REASONS = ("behind", "evicted")


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
        self.pending_pages = 0  # granted by `take` and not yet reported written (engine thread)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # pages not written, by reason
        self._written = written
        self._jobs: queue.Queue[Write] = queue.Queue()
        threading.Thread(target=self._loop, name="kv-tier-write", daemon=True).start()

    @property
    def room(self) -> int:
        """Pages that may be granted now."""
        return max(0, self.limit_pages - self.pending_pages)

    def take(self, pages: int) -> int:
        """Engine thread: how many of `pages` may be queued now (counted as pending until `landed`)."""
        granted = min(pages, self.room)
        self.pending_pages += granted
        return granted

    def drop(self, reason: str, pages: int) -> None:
        self.dropped[reason] += pages

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


class PathWrites:
    """The paths the write_through policies write, each in parts of what the writer has room for: the part being
    written is locked in the cache, the pages past it wait their turn unlocked (the pool may need them more than
    storage does) and are asked for as parts land (`resume`); what the pool evicts first is counted, not written.

    `waiting` holds the ends of the paths with pages waiting, oldest first. It is empty unless the writer has pages
    pending (a path waits only when `take` granted less than it asked for), so a landing always comes to resume it.
    """

    def __init__(self, cache: RadixCache, writer: TierWriter, buffer: torch.Tensor, key: Callable[[Node], str],
                 full: Callable[[Node], bool], also: Callable[[list[str], list[int]], None] | None = None) -> None:
        """`also(keys, pages)`: the other ranks of a tensor-parallel worker store their part of each part."""
        self.cache, self.writer, self.buffer = cache, writer, buffer
        self._key, self._full, self._also = key, full, also
        self.waiting: dict[int, Node] = {}

    def write(self, node: Node) -> None:
        """The path down to `node`: its leading pages not stored yet, as many as the writer has room for."""
        todo = [n for n in self.cache.path(node) if not n.stored and self._full(n)]
        part = todo[:self.writer.take(len(todo))]
        if len(part) < len(todo):
            self.waiting[id(node)] = node
        else:
            self.waiting.pop(id(node), None)
        if not part:
            return
        keys = [self._key(n) for n in part]
        for n in part:
            n.stored = True  # asked for once; a failed write clears it again
        self.cache.lock(part[-1])  # the part's pages (and the path above them) stay until the writer has read them
        self.writer.put(Write(keys, self.buffer, [n.page for n in part], part, locked=part[-1]))
        if self._also is not None:
            self._also(keys, [n.page for n in part])

    def resume(self) -> None:
        """Engine thread, as parts land: the waiting paths' next parts, oldest first, while the writer has room."""
        for node in list(self.waiting.values()):
            if not self.writer.room:
                return
            self.write(node)

    def evicting(self, nodes: list[Node]) -> None:
        """A waiting path whose end the pool evicts waits from its parent on; a page of it not yet written is lost
        (`nodes` come leaves first, so a parent evicted at once follows its child)."""
        for n in nodes:
            if self.waiting.pop(id(n), None) is None:
                continue
            if not n.stored and self._full(n):
                self.writer.drop("evicted", 1)
            if n.parent is not None and n.parent is not self.cache.root:
                self.waiting[id(n.parent)] = n.parent
