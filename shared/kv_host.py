"""HostPages: the host-memory tier of KV pages (--hicache-ratio / --hicache-size), pinned on a GPU.

A victim cache under the pool: a page enters when the pool evicts it (copied device -> host) and goes back when a
request's prefix continues into it (host -> device, into free pages of the pool). Going back leaves the host copy
where it is, so a page evicted again costs no copy. When full, the least recently used page leaves first, unless
the storage writer still reads it (`lend`).

Copies run on the engine thread's current stream, non-blocking to and from pinned memory, coalesced into one copy
per run of consecutive pages: the engine thread never waits for them, and the stream orders them with the steps
(a page is copied out before the step that reuses its pool page writes it; a slot is copied back in before a
later eviction overwrites it). Only the CPU reading a slot (the storage writer) waits, for the event `ready`.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.shared.config import TierConfig
    from pdserve.shared.kv_pool import KVPool

HOST_HEADROOM = 0.9  # of the memory the machine has available, the most a host tier may take


@dataclass
class HostCounts:
    pages_in: int = 0  # pages the pool evicted into host memory
    pages_out: int = 0  # pages copied back into the pool
    dropped: int = 0  # pages evicted that found no slot (every slot busy being written to storage)


class HostPages:
    def __init__(self, num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_bytes = torch.empty(page_shape, dtype=dtype, device="meta").nbytes
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty((num_pages, *page_shape), dtype=dtype, pin_memory=self.cuda)
        self._slots: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self._hashes: dict[str, int | None] = {}  # key -> the page's name for the routers (None: not told)
        self._free = list(range(num_pages - 1, -1, -1))
        self._busy: dict[int, int] = {}  # slot -> storage writes still reading it
        self._orphans: set[int] = set()  # busy slots a `clear` forgot: free once given back
        self.counts = HostCounts()

    @property
    def used(self) -> int:
        return len(self._slots)

    def find(self, keys: list[str]) -> list[int]:
        """The slots of the leading run of `keys` held here (each now the most recently used)."""
        slots = []
        for key in keys:
            slot = self._slots.get(key)
            if slot is None:
                break
            self._slots.move_to_end(key)
            slots.append(slot)
        return slots

    def keep(self, keys: list[str], hashes: list[int | None], pool: torch.Tensor, pages: list[int]
             ) -> tuple[list[int | None], list[int]]:
        """Copy pool `pages` (keys[i] is pages[i]'s) into host slots, the least recently used making room. Returns
        each page's slot (None: no room) and the names of pages that left to make room."""
        slots: list[int | None] = []
        left: list[int] = []
        src, dst = [], []
        fresh: set[int] = set()  # slots taken by this call: never taken twice
        for key, name, page in zip(keys, hashes, pages):
            slot = self._slots.get(key)
            if slot is not None:  # copied back earlier and never changed since: already here
                self._slots.move_to_end(key)
                slots.append(slot)
                continue
            slot = self._take(left, fresh)
            slots.append(slot)
            if slot is None:
                self.counts.dropped += 1
                continue
            fresh.add(slot)
            self._slots[key] = slot
            self._hashes[key] = name
            src.append(page)
            dst.append(slot)
        copy_pages(self.buffer, dst, pool, src)
        self.counts.pages_in += len(src)
        return slots, left

    def _take(self, left: list[int], fresh: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._slots.items():  # least recently used first
            if slot not in self._busy and slot not in fresh:
                del self._slots[key]
                name = self._hashes.pop(key)
                if name is not None:
                    left.append(name)
                return slot
        return None

    def load(self, slots: list[int], pool: torch.Tensor, pages: list[int]) -> None:
        """Copy host `slots` into pool `pages`."""
        copy_pages(pool, pages, self.buffer, slots)
        self.counts.pages_out += len(slots)

    def ready(self) -> torch.cuda.Event | None:
        """An event the CPU waits on before reading what the copies issued so far put in host memory."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the pool's device, the stream the copies ran on
        return event

    def lend(self, slots: list[int]) -> None:
        """Keep `slots` from being reused until `give_back` (the storage writer reads them)."""
        for slot in slots:
            self._busy[slot] = self._busy.get(slot, 0) + 1

    def give_back(self, slots: list[int]) -> None:
        for slot in slots:
            if self._busy[slot] == 1:
                del self._busy[slot]
                if slot in self._orphans:
                    self._orphans.discard(slot)
                    self._free.append(slot)
            else:
                self._busy[slot] -= 1

    def clear(self) -> None:
        """Forget every page (a flush, new weights). Slots being written to storage are reused only once written."""
        self._slots.clear()
        self._hashes.clear()
        self._orphans = set(self._busy)
        self._free = [slot for slot in range(self.num_pages - 1, -1, -1) if slot not in self._busy]

    def names(self) -> list[int]:
        return [name for name in self._hashes.values() if name is not None]


def copy_pages(dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int]) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]], one copy per run of pages consecutive on both sides (non-blocking
    across devices: the host side is pinned)."""
    i, n = 0, len(dst_pages)
    while i < n:
        j = i + 1
        while j < n and dst_pages[j] == dst_pages[j - 1] + 1 and src_pages[j] == src_pages[j - 1] + 1:
            j += 1
        d, s = dst_pages[i], src_pages[i]
        dst[d:d + j - i].copy_(src[s:s + j - i], non_blocking=True)
        i = j


def available_host_bytes() -> int:
    """Memory the machine can still give (MemAvailable; free pages where /proc is not there)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_pages(config: TierConfig, pool: KVPool) -> int:
    """The host tier's size in pages; ValueError naming the flag when the machine has not that memory free."""
    if config.host_ratio is None and config.host_gb is None:
        return 0
    page_bytes = pool.layout.page_bytes
    pages = (int(config.host_gb * 1e9) // page_bytes if config.host_gb is not None
             else int(config.host_ratio * pool.num_pages))
    flag = (f"--hicache-size {config.host_gb:g}" if config.host_gb is not None
            else f"--hicache-ratio {config.host_ratio:g}")
    if pages < pool.num_pages:
        raise ValueError(f"{flag}: the host tier would hold {pages} pages, fewer than the pool's {pool.num_pages}; "
                         f"give at least {pool.num_pages * page_bytes / 1e9:.2f} GB")
    free = available_host_bytes()
    if pages * page_bytes > HOST_HEADROOM * free:
        raise ValueError(f"{flag}: the host tier would take {pages * page_bytes / 1e9:.1f} GB of host memory, and "
                         f"the machine has {free / 1e9:.1f} GB available (at most {HOST_HEADROOM:.0%} of it)")
    return pages
