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
    # "name@version" of the LoRA adapters loaded at start-up: a request's adapter must mean the same weights on
    # both sides (adapters loaded later are checked per request, by version).
    lora_adapters: tuple[str, ...] = ()
    # WeightsVersion.label of the model weights served. Exchanged but not a reason to refuse a peer: a worker
    # restarted after a weight update must be able to rejoin, so that the next update brings it level with the
    # others. Until then, and while an update is under way, a prefill worker refuses each request of a peer on
    # other weights (ServedWeights.check_peer in shared/admin.py).
    weights_version: str = "0"
    # --quantization ("" for none): the KV is laid out alike either way, but a quantized prefill's pages continued
    # by an unquantized decode (or the reverse) would be neither model's output.
    quantization: str = ""

    def mismatches(self, other: Compat, me: str = "this worker", peer: str = "the peer") -> list[str]:
        """Human-readable differences, e.g. "page_size: prefill has 16, decode has 32"."""
        out = []
        for f in fields(self):
            if f.name == "weights_version":
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append(f"{f.name}: {me} has {_show(mine)}, {peer} has {_show(theirs)}")
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "lora_adapters": list(self.lora_adapters)}


def _show(value) -> str:
    if value == "":
        return "none"
    if isinstance(value, tuple):
        return "[" + ", ".join(value) + "]"
    return str(value)


@dataclass(frozen=True)
class WeightsVersion:
    """The weights a worker serves: `number` counts the deployment's updates (0: the checkpoint loaded at
    start-up), `path` is the checkpoint they came from. Prefill and decode move KV only between equal labels."""

    number: int
    path: str
    tag: str = ""  # SGLang's weight_version label, given with the update; says nothing about the weights' identity

    @property
    def label(self) -> str:
        # Workers started together may reach one checkpoint by different paths (a container's mounts), so at
        # start-up the number alone stands for their weights; an update gives every worker the same path.
        return "0" if self.number == 0 else f"{self.number} ({self.path})"
