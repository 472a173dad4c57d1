"""What two workers must agree on before KV pages can move between them.

Checked once, when a decode worker registers with a prefill worker, so a
mismatch is a clear error at start-up instead of garbage at the first request.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Compat:
    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    transfer_backend: str

    def mismatches(self, other: Compat, me: str = "this worker", peer: str = "the peer") -> list[str]:
        """Human-readable differences, e.g. "page_size: prefill has 16, decode has 32"."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append(f"{f.name}: {me} has {mine}, {peer} has {theirs}")
        return out

    def to_dict(self) -> dict:
        return asdict(self)
