"""Kernels of the runtime, one op per module, each with up to three implementations of one contract.

Every op has `<op>_triton` (CUDA, or the Triton interpreter in tests), `<op>_native` (C++ for the
CPU, built by pdserve.kernels.native) and `<op>_torch`, all with the same signature: the torch twin
is the fallback where the others cannot run and the oracle they are tested against.

Exports resolve on first use, so importing the package alone loads neither Triton nor
any kernel. That matters because a checkout's top-level `kernels/` folder can be found
under the plain name `kernels` (transformers probes for a package of that name), and
such a probe should cost nothing.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_cos_sin_cache": "rotary", "cos_sin_rows": "rotary",
    "decode_attention_torch": "decode_attention", "decode_attention_triton": "decode_attention",
    "decode_attention_native": "decode_attention",
    "plan_decode_torch": "decode_attention", "plan_decode_triton": "decode_attention",
    "plan_decode_native": "decode_attention",
    "extend_attention_torch": "extend_attention", "extend_attention_triton": "extend_attention",
    "extend_attention_native": "extend_attention", "extend_attention_cpu": "extend_attention",
    "rmsnorm_torch": "rmsnorm", "rmsnorm_triton": "rmsnorm", "rmsnorm_native": "rmsnorm",
    "rotary_torch": "rotary", "rotary_triton": "rotary",
    "rotary_store_kv_torch": "rotary_kv", "rotary_store_kv_triton": "rotary_kv",
    "rotary_store_kv_native": "rotary_kv",
    "silu_and_mul_torch": "silu_mul", "silu_and_mul_triton": "silu_mul", "silu_and_mul_native": "silu_mul",
    "apply_token_mask": "token_mask", "apply_token_mask_torch": "token_mask",
    "apply_token_mask_native": "token_mask", "apply_token_mask_triton": "token_mask",
    "store_kv_torch": "kv_store", "store_kv_triton": "kv_store",
    "fused_moe_torch": "fused_moe", "fused_moe_triton": "fused_moe", "fused_moe_native": "fused_moe",
    "quantize_rows_torch": "int8_matmul", "quantize_rows_triton": "int8_matmul",
    "quantize_rows_native": "int8_matmul", "dequantize_rows_torch": "int8_matmul",
    "dequantize_rows_triton": "int8_matmul", "dequantize_rows_native": "int8_matmul", "int8_mm": "int8_matmul",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # also lets `from pdserve.kernels import rmsnorm` fall back to the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
