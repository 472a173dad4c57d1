"""The kernel set a model runs with: Triton kernels on CUDA, native C++ kernels on CPU, torch twins as the
fallback everywhere.

All sets share one signature per op (see pdserve.kernels); the torch set is the oracle the others are
tested against. `native` needs its C++ build (pdserve.kernels.native) and a CPU model in fp32 or bf16;
where either is missing, `resolve_kernel_set` says why and the torch set runs instead.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

KERNEL_SETS = ("native", "torch", "triton")


@dataclass(frozen=True)
class KernelOps:
    name: str
    rmsnorm: Callable
    rotary_store_kv: Callable  # rotates q and k of the fused qkv rows, stores k and v, returns q
    silu_and_mul: Callable
    plan_decode: Callable  # (page_table, seq_lens, page_size) -> plan handed to every layer's decode_attention
    decode_attention: Callable
    extend_attention: Callable
    fused_moe: Callable  # the experts of a Mixture-of-Experts layer, grouped by expert
    lora_apply: Callable  # adds each row's LoRA adapter delta into a fused linear's output, in place


def resolve_kernel_set(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel set to run: `requested` unless it is `auto` (native on CPU, triton on CUDA) or impossible here.

    An explicitly requested set that cannot run is an error; `auto` falls back to torch and logs why."""
    if requested not in ("auto",) + KERNEL_SETS:
        raise ValueError(f"unknown kernel set {requested!r} (choose auto, {', '.join(KERNEL_SETS)})")
    if requested == "auto":
        requested = "triton" if device.type == "cuda" else "native"
        explicit = False
    else:
        explicit = True
    if requested != "native":
        return requested
    from pdserve.kernels import native

    reason = None
    if device.type != "cpu":
        reason = f"native kernels run on the CPU, not {device.type}"
    elif dtype not in (torch.float32, torch.bfloat16):
        reason = f"native kernels take float32 or bfloat16, not {dtype}"
    else:
        try:
            native.load()
        except native.NativeUnavailable as exc:
            reason = str(exc)
    if reason is None:
        return "native"
    if explicit:
        raise ValueError(f"--kernels native is not available: {reason}")
    log.warning("native CPU kernels unavailable (%s); running the torch kernels", reason)
    return "torch"


def get_kernel_ops(kernel_set: str, deterministic: bool = False) -> KernelOps:
    """The ops of `kernel_set`. `deterministic`: every op gives a token the same bits whatever the batch,
    chunking or prefix hits around it (native set only: its extend attention then never hands long prompts
    to the tiled torch kernel, whose rows depend on how the prompt was split)."""
    if kernel_set not in KERNEL_SETS:
        raise ValueError(f"unknown kernel set {kernel_set!r} (choose {', '.join(KERNEL_SETS)})")
    if deterministic and kernel_set != "native":
        raise ValueError("deterministic inference needs the native CPU kernels")
    from pdserve.kernels import decode_attention, extend_attention, fused_moe, lora, rmsnorm, rotary_kv, silu_mul

    suffix = "_" + kernel_set
    extend = getattr(extend_attention, "extend_attention" + suffix)
    if kernel_set == "native" and not deterministic:
        extend = extend_attention.extend_attention_cpu
    return KernelOps(
        name=kernel_set,
        rmsnorm=getattr(rmsnorm, "rmsnorm" + suffix),
        rotary_store_kv=getattr(rotary_kv, "rotary_store_kv" + suffix),
        silu_and_mul=getattr(silu_mul, "silu_and_mul" + suffix),
        plan_decode=getattr(decode_attention, "plan_decode" + suffix),
        decode_attention=getattr(decode_attention, "decode_attention" + suffix),
        extend_attention=extend,
        fused_moe=getattr(fused_moe, "fused_moe" + suffix),
        lora_apply=getattr(lora, "lora_apply" + suffix),
    )
