"""KV-cache transfer between workers: one interface (`KVTransfer`), backends chosen by name.

The names below load `base` (and torch) when first used, not when the package is imported: a worker's front
reads `fence` without loading torch."""
from __future__ import annotations

import importlib

__all__ = ["KVTransfer", "Run", "TransferError", "available_backends", "create_transfer", "merge_runs"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("pdserve.shared.transfer.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
