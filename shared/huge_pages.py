"""Weights in 2 MiB pages: where the CPU kernels' packed weights live, so a decode step streams them at the memory's
rate.

A decode step of a few rows reads every weight once, front to back: it is bound by how fast memory streams
them. In 4 KiB pages the CPU's prefetchers stop at every page boundary and each page costs a TLB entry; Linux backs
memory with 2 MiB pages only where asked (`madvise`, the default of /sys/kernel/mm/transparent_hugepage/enabled).
Measured on the default model's bf16 layers and LM head (269 MB, one thread, the fixed-order kernel, alternating,
CPU time): 15.6-19.2 ms a pass in 4 KiB pages, 8.9-10.3 ms in 2 MiB ones.

`place(t)` copies a CPU tensor of at least MIN_BYTES into an arena of anonymous mappings advised MADV_HUGEPAGE
(aligned to 2 MiB; ARENA_BYTES each, or one of the tensor's size), one after the other, and returns the copy: same
values, same dtype and shape, contiguous. A mapping is unmapped when the last tensor in it is freed (each tensor
holds its mapping), and pages never touched cost nothing. Elsewhere (not Linux, not a contiguous CPU tensor, a small
one, or PDSERVE_HUGE_PAGES=0) `t` itself comes back.
"""
from __future__ import annotations

import mmap
import os
import threading

import torch

PAGE = 2 << 20
ARENA_BYTES = 64 << 20
MIN_BYTES = 256 << 10  # below this a tensor sits in a few 4 KiB pages anyway
ALIGN = 64  # each tensor starts on a cache line

_lock = threading.Lock()
_arena: torch.Tensor | None = None  # uint8 view of the current mapping's free tail
_disabled: bool | None = None


def enabled() -> bool:
    global _disabled
    if _disabled is None:
        _disabled = os.environ.get("PDSERVE_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE")
    return not _disabled


def place(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into 2 MiB pages, or `t` itself where that does not apply (see the module's text)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes < MIN_BYTES or not enabled():
        return t
    with _lock:
        buf = _take(-(-nbytes // ALIGN) * ALIGN)[:nbytes]
    out = buf.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _take(nbytes: int) -> torch.Tensor:
    global _arena
    if _arena is None or _arena.numel() < nbytes:
        size = max(ARENA_BYTES, -(-nbytes // PAGE) * PAGE)
        mapping = mmap.mmap(-1, size + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view of it lives
        skip = -whole.data_ptr() % PAGE
        _arena = whole[skip:skip + size]
    taken, _arena = _arena[:nbytes], _arena[nbytes:]
    return taken
