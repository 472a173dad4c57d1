"""Capacity: what the storage directory holds, kept under a size and above a volume's free space.

Limits, SGLang's file backend's: `max_bytes` (--hicache-storage-max-size, or SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE;
0: no cap), `min_free_bytes` (--hicache-storage-min-free-space, or SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE) and
`ratio` (--hicache-storage-eviction-ratio, or SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO; default 0.9). Once a
write takes the directory past `max_bytes`, pages go until it holds `ratio` x `max_bytes`; once the volume's free
space falls under `min_free_bytes`, until that much is free again plus (1 - ratio) of it. What goes first:
identities nobody used for PRESSED_UNUSED_S (older weights, another deployment: whole, kv_identities.sweep), then
this worker's own pages, least recently used first (read or written by this process; before that, by the file's
modification time, which a read refreshes while a limit is set).

Invariant: `total` is the directory's bytes as allocated (whole blocks) at the latest walk, plus every page written
since, less every one deleted. A walk runs on a thread of its own at start, after `use` and `flush`, and every
RESCAN_S (it brings in other workers' writes: each worker on a shared directory evicts its own pages, so between
walks the directory can exceed the cap by what the others wrote since). The first walk also deletes the temporary
files (`.<key>.kv.<suffix>`) older than TEMPORARY_S that a killed worker left. Never an exception for the caller:
a file that cannot be deleted is skipped.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pdserve.shared.kv_identities import PRESSED_UNUSED_S, sweep

log = logging.getLogger(__name__)

RESCAN_S = 60.0
TEMPORARY_S = 60.0  # a temporary file this old belongs to no write under way (a page's write takes milliseconds)
SWEEP_EVERY_S = 60.0  # over the limit, identities unused for PRESSED_UNUSED_S are looked for at most this often
BLOCK = 4096
_KEY = re.compile(r"[0-9a-f]{32}")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_size(text: str | int, what: str) -> int:
    """Bytes from "200GB", "500MB", "1.5G", "2GiB" or a number of bytes (K, M, G, T: powers of 1000; Ki, Mi, Gi,
    Ti: of 1024); ValueError naming `what` for anything else."""
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise ValueError(f"{what} must be a size such as 200GB, 500MB, 2GiB or a number of bytes, got {text!r}")
    return int(float(match[1]) * _UNITS[(match[2] or "").lower()])


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 0  # 0: no cap
    min_free_bytes: int = 0  # 0: none
    ratio: float = 0.9

    @property
    def on(self) -> bool:
        return self.max_bytes > 0 or self.min_free_bytes > 0


@dataclass
class CapacityCounts:
    evicted_pages: int = 0
    evicted_bytes: int = 0
    evicted_identities: int = 0
    temporaries_removed: int = 0


def charge(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


class Capacity:
    def __init__(self, root: Path, file_bytes: int, limits: Limits) -> None:
        self.root, self.limits, self.file_bytes = root, limits, file_bytes
        self.counts = CapacityCounts()
        self.identity = ""
        self._lru: OrderedDict[str, int] = OrderedDict()  # this identity's page files, least recent first
        self._others: dict[str, int] = {}  # bytes of every other identity (and anything else in the directory)
        self._own_bytes = self._other_bytes = 0  # the sums of those two, kept as they change (a write is O(1))
        self._touched: set[str] = set()  # paths written or read since the walk under way began
        self._lock = threading.Lock()
        self._evicting = threading.Lock()
        self._walking = False
        self._walked_at = -RESCAN_S
        self._generation = 0  # a new identity or a flush: what a walk under way finds is of the old one
        self._swept_at = -SWEEP_EVERY_S
        self._free_checked_at = -1.0
        self._first = True

    @property
    def total(self) -> int:
        return self._own_bytes + self._other_bytes

    def occupancy(self) -> tuple[int, int]:
        """(pages, bytes) of this identity's files as of the latest walk plus what was written since; starts a walk
        when the latest is RESCAN_S old (the caller never waits on one)."""
        self._maybe_walk()
        with self._lock:
            return len(self._lru), len(self._lru) * self.file_bytes

    def use(self, identity: str) -> None:
        """Count for `identity` from now on (a flush: the same identity, emptied)."""
        with self._lock:
            self.identity, self._generation = identity, self._generation + 1
            self._lru, self._touched, self._walked_at, self._walking = OrderedDict(), set(), -RESCAN_S, False
            self._own_bytes = 0
        self._maybe_walk()

    def walk_now(self) -> None:
        """Walk the directory on this thread (tests, benchmarks)."""
        with self._lock:
            self._walking, generation = True, self._generation
        self._walk(generation)

    def _maybe_walk(self) -> None:
        with self._lock:
            if self._walking or time.monotonic() - self._walked_at < RESCAN_S or not self.identity:
                return
            self._walking, self._walked_at, self._touched = True, time.monotonic(), set()
            generation = self._generation
        threading.Thread(target=self._walk, args=(generation,), name="kv-files-walk", daemon=True).start()

    def _walk(self, generation: int) -> None:
        own: list[tuple[float, str, int]] = []
        others: dict[str, int] = {}
        now = time.time()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                if not entry.is_dir(follow_symlinks=False) or not _KEY.fullmatch(entry.name):
                    continue
                for sub in _entries(entry.path):
                    for f in _entries(sub.path):
                        with contextlib.suppress(OSError):
                            st = f.stat(follow_symlinks=False)
                            if f.name.startswith("."):  # a write under way, or one a killed worker left
                                if self._first and now - st.st_mtime >= TEMPORARY_S:
                                    os.unlink(f.path)
                                    self.counts.temporaries_removed += 1
                            elif entry.name == self.identity:
                                own.append((st.st_mtime, f.path, st.st_blocks * 512))
                            else:
                                others[entry.name] = others.get(entry.name, 0) + st.st_blocks * 512
        own.sort()
        with self._lock:
            self._walking = False
            if generation != self._generation:
                return
            lru = OrderedDict((path, size) for _, path, size in own)
            for path in list(self._lru):  # what this process read or wrote since the walk began is the most recent
                if path in self._touched:
                    lru[path] = self._lru[path]
                    lru.move_to_end(path)
            self._lru, self._others, self._touched = lru, others, set()
            self._own_bytes, self._other_bytes = sum(lru.values()), sum(others.values())
            if self._first and self.counts.temporaries_removed:
                log.info("KV storage tier %s: %d temporary files of writes never finished removed", self.root,
                         self.counts.temporaries_removed)
            self._first = False
        self.make_room()

    def added(self, path: Path) -> None:
        """A page file written (renamed into place)."""
        with self._lock:
            if str(path) not in self._lru:
                self._own_bytes += charge(self.file_bytes)
            self._lru[str(path)] = charge(self.file_bytes)
            self._lru.move_to_end(str(path))
            self._touched.add(str(path))
        self.make_room()
        self._maybe_walk()

    def used(self, path: Path) -> None:
        """A page file read."""
        key = str(path)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                self._touched.add(key)
        if self.limits.on:
            with contextlib.suppress(OSError):
                os.utime(path, follow_symlinks=False)  # the recency a restarted worker's walk starts from

    def removed(self, path: Path) -> None:
        with self._lock:
            self._own_bytes -= self._lru.pop(str(path), 0)

    def make_room(self) -> None:
        """Delete down to the limits (see the module's docstring); at once when within them."""
        need = self._excess()
        if need <= 0 or not self._evicting.acquire(blocking=False):
            return  # another thread is deleting already
        try:
            if time.monotonic() - self._swept_at >= SWEEP_EVERY_S:  # others' unused identities first
                self._swept_at = time.monotonic()
                for key in sweep(self.root, self.identity, PRESSED_UNUSED_S):
                    with self._lock:
                        self._other_bytes -= self._others.pop(key, 0)
                    self.counts.evicted_identities += 1
                need = self._excess()
            while need > 0:
                with self._lock:
                    if not self._lru:
                        break
                    path, size = self._lru.popitem(last=False)
                    self._own_bytes -= size
                with contextlib.suppress(FileNotFoundError), _logged(path):
                    os.unlink(path)
                    self.counts.evicted_pages += 1
                    self.counts.evicted_bytes += size
                need -= size
        finally:
            self._evicting.release()

    def _excess(self) -> int:
        """Bytes to delete now (0 or less: none)."""
        limits, need = self.limits, 0
        with self._lock:
            total = self.total
        if limits.max_bytes and total > limits.max_bytes:
            need = total - int(limits.ratio * limits.max_bytes)
        if limits.min_free_bytes and time.monotonic() - self._free_checked_at >= 1.0:
            self._free_checked_at = time.monotonic()
            with contextlib.suppress(OSError):
                st = os.statvfs(self.root)
                free = st.f_bavail * st.f_frsize
                if free < limits.min_free_bytes:
                    self._free_checked_at = -1.0  # until the space is back, check at every write
                    need = max(need, limits.min_free_bytes - free + int((1 - limits.ratio) * limits.min_free_bytes))
        return need


def _entries(path: str) -> list[os.DirEntry]:
    try:
        return [e for e in os.scandir(path)]
    except OSError:
        return []


@contextlib.contextmanager
def _logged(path: str):
    try:
        yield
    except OSError as exc:
        log.info("KV storage tier: %s could not be evicted: %s", path, exc)
