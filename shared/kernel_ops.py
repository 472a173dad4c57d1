"""The kernel set a model runs with: Triton kernels on CUDA, their torch twins on CPU.

Both sets share one signature per op (see pdserve.kernels); the torch set is the
CPU serving path and the oracle the Triton set is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelOps:
    name: str
    rmsnorm: Callable
    rotary: Callable
    silu_and_mul: Callable
    store_kv: Callable
    plan_decode: Callable  # (page_table, seq_lens, page_size) -> plan handed to every layer's decode_attention
    decode_attention: Callable
    extend_attention: Callable


def get_kernel_ops(backend: str) -> KernelOps:
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown attention backend {backend!r} (choose torch or triton)")
    from pdserve.kernels import decode_attention, extend_attention, kv_store, rmsnorm, rotary, silu_mul

    suffix = "_" + backend
    return KernelOps(
        name=backend,
        rmsnorm=getattr(rmsnorm, "rmsnorm" + suffix),
        rotary=getattr(rotary, "rotary" + suffix),
        silu_and_mul=getattr(silu_mul, "silu_and_mul" + suffix),
        store_kv=getattr(kv_store, "store_kv" + suffix),
        plan_decode=getattr(decode_attention, "plan_decode" + suffix),
        decode_attention=getattr(decode_attention, "decode_attention" + suffix),
        extend_attention=getattr(extend_attention, "extend_attention" + suffix),
    )
