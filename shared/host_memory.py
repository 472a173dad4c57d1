"""Host allocator settings for the CPU serving path.

torch takes CPU tensors straight from the C library's malloc. glibc by default serves
blocks above a moving threshold with fresh mmap()s and hands freed memory at the top of
the heap back to the kernel. A forward step frees and re-allocates the same megabytes of
activations and gathered KV in every layer, so each of those allocations comes back as
new pages and faults them in again, one by one. With freed memory kept in the heap the
next layer and the next step reuse warm pages: a batch-32 decode step at 300 tokens of
context went from about 210 ms to 75 ms on a 2-core host (`benchmarks/bench_runtime.py`
shows the same effect at shorter contexts, smaller).
"""
from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameter numbers
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit; bigger blocks still get their own mapping
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap for reuse


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks for reuse. Process-wide and idempotent; False where the C library
    is not glibc (macOS, musl), where there is nothing to set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
