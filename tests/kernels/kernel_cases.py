"""Shared helpers of the kernel tests: devices, tolerances, paged KV batches, naive oracles, and bad-input calls
run where a crash cannot take the test run down."""
from __future__ import annotations

import faulthandler
import math
import os
import select
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from pdserve.kernels import native

HAS_CUDA = torch.cuda.is_available()
# Torch references run everywhere; Triton kernels run on CUDA, or in the interpreter on CPU.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
# bf16 is broken in the Triton interpreter: checked only on a real GPU.
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Attention against the float64 oracle: the torch twin's own bounds.
REF_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NATIVE_DTYPES = [torch.float32, torch.bfloat16]
# (head_dim, group) of the native attention tests: every GQA group the kernel compiles an AVX-512 body for, at
# both head_dims it specialises, and head_dims that take its portable path.
NATIVE_HEADS = [(d, g) for d in (64, 128) for g in (1, 3, 4, 7, 8)] + [(80, 3), (32, 8)]


def _native_missing() -> str | None:
    try:
        native.load()
    except native.NativeUnavailable as exc:
        return str(exc)
    return None


_NATIVE_MISSING = _native_missing()
needs_native = pytest.mark.skipif(_NATIVE_MISSING is not None,
                                  reason=f"native CPU kernels unavailable: {_NATIVE_MISSING}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@dataclass
class PagedKV:
    """K/V of several sequences, both as contiguous per-sequence tensors and scattered into a paged pool."""
    pool: torch.Tensor  # [P, L, 2, S, Hk, D]
    k_cache: torch.Tensor  # pool[:, layer, 0], strided
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [len, Hk, D]
    values: list[torch.Tensor]


def make_paged_kv(lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: str, seed: int = 0, num_layers: int = 3, layer: int = 1) -> PagedKV:
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(needed) + 3  # spare pages hold garbage that must never be read
    # Garbage everywhere (other layers, spare pages, page tails) so a stray read shows up.
    pool = (torch.randn(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim, generator=gen) * 100)
    pool = pool.to(dtype=dtype, device=device)
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    order = torch.randperm(num_pages, generator=gen).tolist()  # shuffled, non-contiguous page ids
    table, keys, values = [], [], []
    for n, count in zip(lens, needed):
        pages, order = order[:count], order[count:]
        table.append(pages + [0] * (max(needed) - count))
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        for pos in range(n):  # naive per-token scatter
            k_cache[pages[pos // page_size], pos % page_size] = k[pos]
            v_cache[pages[pos // page_size], pos % page_size] = v[pos]
        keys.append(k)
        values.append(v)
    return PagedKV(pool, k_cache, v_cache,
                   torch.tensor(table, dtype=torch.int32, device=device),
                   torch.tensor(lens, dtype=torch.int32, device=device), keys, values)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """Dense causal attention in float64, one head and one query at a time.

    q: [n, Hq, D] at absolute positions first_pos..first_pos+n-1; k, v: [L, Hk, D]. Returns [n, Hq, D] fp64.
    """
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    with torch_threads(1):  # many tiny ops: on a busy machine, waking a second thread costs more than the work
        for i in range(n):
            visible = first_pos + i + 1
            for h in range(num_heads):
                kh = k[:visible, h // group].double().cpu()
                vh = v[:visible, h // group].double().cpu()
                weights = torch.softmax(kh @ q[i, h].double().cpu() * scale, dim=0)
                out[i, h] = weights @ vh
    return out


def strided_q(n: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int = 7) -> torch.Tensor:
    """[n, Hq, D] queries as the model hands them over: a view into the rows of a fused qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    return qkv[:, :num_heads * head_dim].view(n, num_heads, head_dim)


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def error_in_child(call: Callable[[], object], timeout: float = 60.0) -> str:
    """The error `call` raises, run in a forked child process.

    A check missing from a native kernel shows up as a segfault or a silent write past a tensor, not an
    exception: in a child, that fails the test instead of killing or corrupting the test run."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it exits here and never returns into pytest
        code = 3
        try:
            os.close(read)
            faulthandler.disable()  # a crash is reported by the parent, without a dump of pytest's stack
            torch.set_num_threads(1)  # the parent's OpenMP workers did not survive the fork: stay on this thread
            try:
                call()
                code, message = 2, "returned without raising"
            except Exception as exc:
                code, message = 0, f"{type(exc).__name__}: {exc}"
            os.write(write, message.encode()[:4000])
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        if not select.select([pipe], [], [], timeout)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"still running after {timeout} s")
        message = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail(f"crashed with signal {os.WTERMSIG(status)} instead of raising")
    assert os.WEXITSTATUS(status) == 0, message
    return message

