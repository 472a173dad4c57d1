"""KV-cache transfer between workers: one interface (`KVTransfer`), backends chosen by name."""
from __future__ import annotations

from pdserve.shared.transfer.base import (KVTransfer, Run, TransferError, available_backends, create_transfer,
                                          merge_runs)

__all__ = ["KVTransfer", "Run", "TransferError", "available_backends", "create_transfer", "merge_runs"]
