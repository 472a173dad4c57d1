"""Bytes between torch.distributed ranks, never pickled.

torch.distributed's `all_gather_object` and `broadcast_object_list` unpickle what every peer sends: a peer that
can write into the group (or a process that reached its store or its gloo ports) would run code in every rank.
Here a rank's bytes travel as a uint8 tensor after their length (an int64 tensor), each length is checked
against MAX_BYTES before anything is allocated for it, and what arrives is handed back as bytes for its reader
to parse with a schema (JSON of known fields, decimal integers); nothing is ever unpickled.
"""
from __future__ import annotations

import torch

MAX_BYTES = 1 << 20  # one rank's part of an exchange: KV agents' metadata, counts


class BadExchange(ValueError):
    """A rank's part of an exchange is not what a pdserve rank sends."""


def gather_bytes(dist, data: bytes, size: int, device: torch.device) -> list[bytes]:
    """Every rank's `data`, in rank order (call on every rank together)."""
    if len(data) > MAX_BYTES:
        raise BadExchange(f"{len(data)} bytes to exchange between the ranks, past the {MAX_BYTES} they take")
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(size)]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    bad = [f"rank {r}: {n}" for r, n in enumerate(sizes) if not 0 <= n <= MAX_BYTES]
    if bad:
        raise BadExchange(f"a rank's part of an exchange claims a length outside 0..{MAX_BYTES} bytes "
                          f"({', '.join(bad)})")
    longest = max(1, *sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(parts, mine.to(device))
    return [part[:n].cpu().numpy().tobytes() for part, n in zip(parts, sizes)]
