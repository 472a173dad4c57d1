"""The keys of KV pages in the tiers below the pool (kv_tiers.py): what makes KV computed in one place reusable in
another, and the chained hash that names each page from it.

A page's key is a hash chained over the tokens of every page before it and its own, starting from the identity
of what computed them (`kv_identity`: the model's weights, dtype, page layout, quantization, kernels, device
type; a LoRA adapter's or a salted prompt's namespace is in the first page's key). Two pages share a key only
when the same tokens, after the same prefix, went through the same weights the same way.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.shared.config import RuntimeConfig
    from pdserve.shared.kv_pool import KVPool

KEY_BYTES = 16  # 32 hex digits


def kv_identity(config: RuntimeConfig, pool: KVPool) -> dict:
    """What makes KV computed here reusable elsewhere: the same weights through the same arithmetic and layout."""
    layout = pool.layout
    return {"weights": model_fingerprint(config.model_path), "dtype": str(layout.dtype),
            "page_size": layout.page_size, "layers": layout.num_layers, "kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "quantization": config.quantization, "kernels": config.kernels,
            "deterministic": config.deterministic, "device": torch.device(config.device).type}


def model_fingerprint(model_path: str) -> str:
    """What identifies a checkpoint's weights wherever it is mounted: its config and, per weight file, its name,
    size and the hash of its first MiB (a different checkpoint differs there; reading whole files would cost
    seconds per gigabyte at every start)."""
    h = hashlib.blake2b(digest_size=16)
    root = Path(model_path)
    if not root.exists():  # a name rather than a path: the name is all there is to go by
        h.update(model_path.encode())
        return h.hexdigest()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".pt")) \
            if root.is_dir() else [root]:
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()


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
