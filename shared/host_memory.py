"""Host memory: allocator settings for the CPU serving path, and uploads that do not wait (GPU path).

torch takes CPU tensors straight from the C library's malloc. glibc by default serves
blocks above a moving threshold with fresh mmap()s and hands freed memory at the top of
the heap back to the kernel. A forward step allocates and frees megabytes of activations
and gathered KV in every layer, in sizes that change with the batch, so those blocks keep
coming back as new pages that fault in one by one. Kept in the heap, they are reused warm:
`benchmarks/bench_host_memory.py` (a mixed prefill and decode workload) counts 40-160x
fewer page faults.

On a GPU, `torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the device's
whole queue: a step's inputs built that way wait for the step still running before them (shared/overlap.py).
`upload` goes through pinned memory without blocking instead.
"""
from __future__ import annotations

import ctypes
import sys

import torch

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


def upload(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or a CPU tensor) as a tensor on `device`, without waiting for the device's queued work."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
