"""LoRA adapters: what a loaded adapter is, the model's fused layout it comes in, and the slots a batch reads.

Lifecycle: `lora_checkpoint.load_adapter` reads and checks a PEFT directory and returns a `LoraAdapter` whose
weights are already fused like the model's linears (q|k|v, gate|up) for one slot, or raises `LoraError`.
`LoraPool` owns the slot tensors the LoRA op reads, allocated at start-up: an adapter is copied into a slot when
a request needs it and stays until the slot goes to another (the least recently used one without requests).

Layout of one layer's fused linear with sub-modules j (q, k, v for qkv), S slots, rank R:
  lora_a [S, n_sub * R, in]: rows j*R .. j*R + rank are sub-module j's A; the rest are zero.
  lora_b [S, out, R]: row o is scaling * B_j[o - off_j] of the sub-module j owning output column o.
so slot s adds, for every j: y[:, off_j:off_j+1] += (x @ lora_a[s, j*R:(j+1)*R].T) @ lora_b[s, off_j:off_j+1].T.
Invariant: every element of a slot outside its adapter's own weights is zero (an empty slot is all zeros).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from pdserve.shared.config import ModelConfig

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's fused linears and the PEFT modules whose rows they concatenate, in order.
FUSED_LINEARS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                             "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class LoraError(ValueError):
    """An adapter cannot be loaded or placed; the message names the adapter and the problem."""


class AdapterNotFound(LoraError):
    """No adapter at the path; the message says why, for the log (API callers get one answer:
    worker/engine_admin_calls.py)."""


class LinearShape(NamedTuple):
    in_features: int
    out_sizes: tuple[int, ...]  # rows of each sub-module in the fused output

    @property
    def out_offsets(self) -> tuple[int, ...]:
        return (0, *itertools.accumulate(self.out_sizes))


class LoraWeights(NamedTuple):
    a: torch.Tensor  # [n_sub * rank, in]
    b: torch.Tensor  # [out, rank], scaling folded in


class LoraLayer(NamedTuple):
    """What the LoRA op reads for one layer's fused linear."""

    lora_a: torch.Tensor  # [S, n_sub * R, in]
    lora_b: torch.Tensor  # [S, out, R]
    out_offsets: tuple[int, ...]  # n_sub + 1 column bounds of the sub-modules in the fused output


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; already folded into each b
    target_modules: tuple[str, ...]  # the PEFT modules it changes, in SUPPORTED_TARGETS order
    version: str  # sha256 of adapter_config.json and the weights file: equal on prefill and decode
    weights: dict[tuple[int, str], LoraWeights]  # (layer, fused linear) -> its fused A and B, only those touched


def linear_shapes(config: ModelConfig, shards=None) -> dict[str, LinearShape]:
    """The fused linears' input width and sub-module output sizes for this model (for one tensor-parallel rank's
    shards of it, with `shards`)."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    if shards is not None:
        q, kv = shards.num_heads * config.head_dim, shards.num_kv_heads * config.head_dim
        inter = shards.intermediate[1] - shards.intermediate[0]
    return {"qkv": LinearShape(h, (q, kv, kv)), "o": LinearShape(q, (h,)),
            "gate_up": LinearShape(h, (inter, inter)), "down": LinearShape(inter, (h,))}


def shard_weights(linear: str, weights: LoraWeights, config: ModelConfig, shards) -> LoraWeights:
    """One tensor-parallel rank's part of an adapter's fused A and B for `linear`, cut as its base layer is: a
    column-parallel layer (qkv, gate_up) keeps all of A and its rows of B; a row-parallel one (o, down) its
    columns of A and all of B, so its partial deltas add up over the ranks with the base layer's."""
    D = config.head_dim
    (h0, h1), (k0, k1), (i0, i1) = shards.heads, shards.kv_heads, shards.intermediate
    q = config.num_heads * D
    kv = config.num_kv_heads * D
    a, b = weights
    if linear == "qkv":
        b = torch.cat([b[h0 * D:h1 * D], b[q + k0 * D:q + k1 * D], b[q + kv + k0 * D:q + kv + k1 * D]])
    elif linear == "gate_up":
        inter = config.intermediate_size
        b = torch.cat([b[i0:i1], b[inter + i0:inter + i1]])
    elif linear == "o":
        a = a[:, h0 * D:h1 * D]
    elif linear == "down":
        a = a[:, i0:i1]
    return LoraWeights(a.contiguous(), b.contiguous())


def check_target_modules(names: Sequence[str] | None) -> tuple[str, ...]:
    """The server's --lora-target-modules, validated, in SUPPORTED_TARGETS order (None: all of them)."""
    if names is None:
        return SUPPORTED_TARGETS
    unknown = [n for n in names if n not in SUPPORTED_TARGETS]
    if unknown or not names:
        raise ValueError(f"--lora-target-modules: {', '.join(unknown) or 'none given'} "
                         f"(supported: {', '.join(SUPPORTED_TARGETS)})")
    return tuple(m for m in SUPPORTED_TARGETS if m in names)


class LoraPool:
    """The S adapter slots a batch can use: their tensors, and which adapter each holds.

    The tensors cover every layer and fused linear that the allowed target modules can touch (never a MoE
    model's MLP) and are never resized. `in_use` counts an adapter's running requests: `acquire` adds one,
    `release` takes it back; a slot with running requests is never evicted.
    """

    def __init__(self, model_config: ModelConfig, *, max_loras: int, max_rank: int,
                 target_modules: Sequence[str] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", shards=None) -> None:
        """`shards`: one tensor-parallel rank's, whose slots hold each adapter cut as the base layers are.
        `mirror` (set by rank 0 of a tensor-parallel worker): told of every slot written or emptied, so that every
        rank's slots hold the same adapters."""
        if max_loras < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {max_loras}")
        if max_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {max_rank}")
        self.model_config, self.max_rank, self.dtype, self.device = model_config, max_rank, dtype, device
        self.target_modules = check_target_modules(target_modules)
        self.shards = shards
        self.mirror = None
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [S], 0 for an empty slot
        self._layers: dict[tuple[int, str], LoraLayer] = {}
        for linear, shape in linear_shapes(model_config, shards).items():
            if model_config.moe is not None and linear in ("gate_up", "down"):
                continue
            if not any(m in self.target_modules for m in FUSED_LINEARS[linear]):
                continue
            n_sub, out = len(shape.out_sizes), shape.out_offsets[-1]
            for i in range(model_config.num_layers):
                self._layers[(i, linear)] = LoraLayer(
                    torch.zeros(max_loras, n_sub * max_rank, shape.in_features, dtype=dtype, device=device),
                    torch.zeros(max_loras, out, max_rank, dtype=dtype, device=device), shape.out_offsets)
        self._adapters: list[LoraAdapter | None] = [None] * max_loras
        self._uses = [0] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0
        self._touched: Counter[tuple[int, str]] = Counter()  # slots whose adapter changes each (layer, linear)

    @property
    def num_slots(self) -> int:
        return len(self._adapters)

    def slot_of(self, name: str) -> int | None:
        for slot, adapter in enumerate(self._adapters):
            if adapter is not None and adapter.name == name:
                return slot
        return None

    def in_use(self, name: str) -> int:
        slot = self.slot_of(name)
        return 0 if slot is None else self._uses[slot]

    def can_acquire(self, name: str) -> bool:
        return self.slot_of(name) is not None or self._free_slot() is not None

    def acquire(self, adapter: LoraAdapter) -> int:
        """Count one more running request of `adapter` and return its slot, writing it in first if needed."""
        self._check_fits(adapter)
        slot = self.slot_of(adapter.name)
        held = None if slot is None else self._adapters[slot]
        if slot is not None and held is not None and held.version != adapter.version:  # reloaded under its name
            if self._uses[slot]:
                raise LoraError(f"adapter {adapter.name!r}: version {adapter.version} requested while "
                                f"{self._uses[slot]} running requests use version {held.version}")
            self._clear(slot)
            slot = None
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise LoraError(f"adapter {adapter.name!r}: all {self.num_slots} LoRA slots hold adapters of "
                                f"running requests (--max-loras-per-batch {self.num_slots})")
            if self._adapters[slot] is not None:
                self._clear(slot)
            self._write(slot, adapter)
        self._uses[slot] += 1
        self._touch(slot)
        return slot

    def release(self, name: str) -> None:
        """One request of adapter `name` finished."""
        slot = self.slot_of(name)
        if slot is None or self._uses[slot] == 0:
            raise RuntimeError(f"adapter {name!r}: released more often than acquired")
        self._uses[slot] -= 1
        self._touch(slot)

    def evict(self, name: str) -> None:
        """Empty the slot of adapter `name` (nothing if it holds none)."""
        slot = self.slot_of(name)
        if slot is None:
            return
        if self._uses[slot]:
            raise LoraError(f"adapter {name!r}: cannot evict it while {self._uses[slot]} running requests use it")
        self._clear(slot)

    def put(self, slot: int, adapter: LoraAdapter | None) -> None:
        """A follower rank of a tensor-parallel worker: slot `slot` holds `adapter` (None: empty), as rank 0's
        mirror said."""
        if self._adapters[slot] is not None:
            self._clear(slot)
        if adapter is not None:
            self._write(slot, adapter)

    @property
    def covered(self) -> dict[tuple[int, str], LoraLayer]:
        """Every (layer, fused linear) the slots cover, with its tensors, whether or not a slot's adapter changes it."""
        return self._layers

    def layer(self, i: int, linear: str) -> LoraLayer | None:
        """Layer `i`'s tensors for fused `linear`, or None when no slot's adapter changes it (skip the op)."""
        return self._layers[(i, linear)] if self._touched[(i, linear)] > 0 else None

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one whose adapter no running request needs."""
        for slot, adapter in enumerate(self._adapters):
            if adapter is None:
                return slot
        idle = [slot for slot, uses in enumerate(self._uses) if uses == 0]
        return min(idle, key=self._last_used.__getitem__, default=None)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock

    def _check_fits(self, adapter: LoraAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise LoraError(f"adapter {adapter.name!r}: rank {adapter.rank} exceeds --max-lora-rank {self.max_rank}")
        uncovered = {linear for key in adapter.weights if key not in self._layers for linear in key[1:]}
        if uncovered:
            names = ", ".join(linear for linear in FUSED_LINEARS if linear in uncovered)
            raise LoraError(f"adapter {adapter.name!r}: changes {names}, which the LoRA slots do not cover "
                            f"(--lora-target-modules {', '.join(self.target_modules)})")

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        rank = adapter.rank
        for key, weights in adapter.weights.items():
            lora_a, lora_b, offsets = self._layers[key]
            if self.shards is not None:
                weights = shard_weights(key[1], weights, self.model_config, self.shards)
            n_sub = len(offsets) - 1
            lora_a[slot].view(n_sub, self.max_rank, -1)[:, :rank] = weights.a.view(n_sub, rank, -1)
            lora_b[slot, :, :rank] = weights.b
            self._touched[key] += 1
        self.ranks[slot] = rank
        self._adapters[slot] = adapter
        if self.mirror is not None:
            try:
                self.mirror.wrote(slot, adapter)
            except LoraError:
                self._clear(slot)
                raise

    def _clear(self, slot: int) -> None:
        """Zero what the slot's adapter wrote: the rest of the slot is zero already."""
        adapter = self._adapters[slot]
        assert adapter is not None
        for key in adapter.weights:
            self._layers[key].lora_a[slot].zero_()
            self._layers[key].lora_b[slot].zero_()
            self._touched[key] -= 1
        self.ranks[slot] = 0
        self._adapters[slot] = None
        self._uses[slot] = 0
        if self.mirror is not None:
            self.mirror.cleared(slot)
