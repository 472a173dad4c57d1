"""The error every KV transfer raises, in a module without torch: the worker's front (fence leases) imports it."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer or connection failed, timed out, or the peer is incompatible or gone."""
