"""The keys of KV pages in the tiers below the pool (kv_tiers.py): what makes KV computed in one place reusable in
another, and the chained hash that names each page from it.

A page's key is a hash chained over the tokens of every page before it and its own, starting from the identity
of what computed them (`kv_identity`). Two pages share a key only when the same tokens, after the same prefix,
went through the same weights the same way:
- the weights: a digest of every byte the loader reads (weights_digest.py), not their names or sizes, so a
  fine-tune saved like its base, or a file replaced by one of the same size, is other weights;
- the arithmetic as it was resolved at start, not as it was asked for: the kernel set and the function each op
  runs, the native build (its -march, the vector paths it compiled, a digest of its sources), which matmul
  kernel the layers took (oneDNN, the fixed-order kernel, wide steps in fp32), torch's and oneDNN's versions, the
  CPU (vendor, family and model, and the instruction sets its kernels dispatch on) or GPU, and the
  tensor-parallel layout (size, this rank, its KV heads, how partial sums meet);
- the page's layout: dtype, page size, layers, KV heads, head dim; quantization and deterministic mode.
A LoRA adapter's or a salted prompt's namespace is in the first page's key.

Whatever is not named here is trusted to compute alike: the Python code of the model between those kernels, and
a CPU's microcode.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.shared.weights_digest import weights_digest

if TYPE_CHECKING:
    from pdserve.shared.config import RuntimeConfig
    from pdserve.shared.model_runner import ModelRunner

KEY_BYTES = 16  # 32 hex digits
# The CPU features whose presence changes which kernel oneDNN, ATen or a native build runs (and with it the order
# in which products are summed).
ARITHMETIC_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                       "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def kv_identity(config: RuntimeConfig, runner: ModelRunner) -> dict:
    """What makes KV computed here reusable elsewhere: the same weights through the same arithmetic and layout."""
    layout = runner.pool.layout
    return {"weights": weights_digest(config.model_path), "dtype": str(layout.dtype),
            "page_size": layout.page_size, "layers": layout.num_layers, "kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "quantization": config.quantization,
            "deterministic": config.deterministic, "device": runner.device.type,
            "kernels": resolved_kernels(runner, config.deterministic), "tp": tp_layout(runner)}


def resolved_kernels(runner: ModelRunner, deterministic: bool) -> dict:
    """The kernels the model runs, as resolved at start (see the module docstring)."""
    ops = runner.ops
    kernels = {"set": ops.name,
               "ops": {f.name: getattr(getattr(ops, f.name), "__qualname__", type(getattr(ops, f.name)).__name__)
                       for f in dataclasses.fields(ops) if f.name != "name"},
               "torch": torch.__version__}
    if runner.device.type == "cuda":
        kernels["gpu"] = {"name": torch.cuda.get_device_name(runner.device), "cuda": torch.version.cuda,
                          "capability": list(torch.cuda.get_device_capability(runner.device))}
        return kernels
    kernels.update(native=native_build(), matmul=cpu_matmul(runner.dtype, deterministic), onednn=onednn_version(),
                   cpu=cpu_class())
    return kernels


def native_build() -> dict | None:
    """The native kernels' build this process loaded: its -march, the vector paths it compiled (`isa()`), a
    digest of its sources; None where there is none (the torch twins run)."""
    from pdserve.kernels import native

    try:
        isa = native.load().isa()
    except native.NativeUnavailable:
        return None
    return {"march": native.default_march(), "isa": isa, "sources": _native_sources()}


@functools.cache
def _native_sources() -> str:
    from pdserve.kernels import native

    h = hashlib.blake2b(digest_size=8)
    for path in sorted(Path(native.__file__).parent.glob("*.[ch]*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cpu_matmul(dtype: torch.dtype, deterministic: bool) -> str:
    """Which kernel the layers' weight matmuls run on (shared/linear.py's choice, made once per process)."""
    from pdserve.shared import linear

    if deterministic or (dtype == torch.bfloat16 and linear.fixed_order_pays()):
        return "fixed-order"
    kind = "onednn" if torch.backends.mkldnn.is_available() else "torch"
    if dtype == torch.bfloat16 and linear.wide_f32_pays():
        kind += f", steps of {linear.WIDE_MIN_ROWS}+ rows in fp32"
    return kind


@functools.cache
def onednn_version() -> str:
    found = re.search(r"(?:MKL-DNN|oneDNN) v(\S+)", torch.__config__.show())
    return found.group(1) if found else ""


@functools.cache
def cpu_class() -> dict:
    """The CPU as far as its arithmetic goes: vendor, family and model, the instruction sets its kernels
    dispatch on, ATen's capability, and a oneDNN ceiling set in the environment."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("vendor_id", "cpu family", "model", "flags") and name not in info:
                    info[name] = value.strip()
                if name == "" and info:
                    break  # the first processor's block is enough
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {"model": " ".join(info.get(k, "?") for k in ("vendor_id", "cpu family", "model")),
            "features": [f for f in ARITHMETIC_FEATURES if f in flags],
            "aten": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "")}


def tp_layout(runner: ModelRunner) -> dict:
    """This rank's place in a tensor-parallel worker (size 1 without one): its KV heads are its pages' heads."""
    tp = runner.tp
    if tp is None:
        return {"size": 1}
    shards = tp.shards
    return {"size": shards.size, "rank": shards.rank, "kv_heads": list(shards.kv_heads),
            "all_reduce": type(tp.group).__name__}


def identity_key(identity: dict) -> str:
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=KEY_BYTES).hexdigest()


def chain_keys(identity: str, pages: list[tuple]) -> list[str]:
    """The key of each page of a run, given the radix cache's page keys (token ids, with a namespace string
    first in the first page's key when there is one)."""
    keys, prev = [], bytes.fromhex(identity)
    for page in pages:
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        for item in page:
            h.update(b"\xffns" + item.encode() + b"\0" if isinstance(item, str) else item.to_bytes(4, "little", signed=True))
        prev = h.digest()
        keys.append(prev.hex())
    return keys
