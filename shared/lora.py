"""LoRA adapters: PEFT checkpoints validated and fused into the model's layout, and the slots a batch reads.

Lifecycle: `load_adapter` reads a PEFT directory (adapter_config.json + adapter_model.safetensors), checks it
in full against the base model and the server's limits, and returns a `LoraAdapter` whose weights are already
fused like the model's linears (q|k|v, gate|up) for one slot; or it raises `LoraError` and nothing is loaded.
`LoraPool` owns the slot tensors the LoRA op reads, allocated at start-up: an adapter is copied into a slot when
a request needs it and stays until the slot goes to another (the least recently used one without requests).

Layout of one layer's fused linear with sub-modules j (q, k, v for qkv), S slots, rank R:
  lora_a [S, n_sub * R, in]: rows j*R .. j*R + rank are sub-module j's A; the rest are zero.
  lora_b [S, out, R]: row o is scaling * B_j[o - off_j] of the sub-module j owning output column o.
so slot s adds, for every j: y[:, off_j:off_j+1] += (x @ lora_a[s, j*R:(j+1)*R].T) @ lora_b[s, off_j:off_j+1].T.
Invariant: every element of a slot outside its adapter's own weights is zero (an empty slot is all zeros).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
from safetensors.torch import load as load_safetensors

from pdserve.shared.config import ModelConfig

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's fused linears and the PEFT modules whose rows they concatenate, in order.
FUSED_LINEARS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                             "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_FUSED_OF = {m: (linear, j) for linear, mods in FUSED_LINEARS.items() for j, m in enumerate(mods)}
_PARENT = {m: "mlp" if m in MLP_TARGETS else "self_attn" for m in SUPPORTED_TARGETS}
_NOT_LAYERS = ("model.embed_tokens", "lm_head")  # what a target may match outside the decoder layers

# adapter_config.json settings that change the forward beyond x @ A.T @ B.T * scaling, or train whole modules.
_UNSUPPORTED = {
    "use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "trainable_token_indices": "trainable token embeddings", "lora_bias": "a LoRA bias (lora_bias)",
    "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication", "target_parameters": "LoRA on parameters (target_parameters)",
    "use_qalora": "QA-LoRA", "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing", "use_bdlora": "block-diagonal LoRA (use_bdlora)", "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA", "kasa_config": "KaSA", "mica": "MiCA",
}


class LoraError(ValueError):
    """An adapter cannot be loaded or placed; the message names the adapter and the problem."""


class AdapterNotFound(LoraError):
    """No adapter at the path; the message says why, for the log (API callers get one answer: worker/rpc.py)."""


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


def linear_shapes(config: ModelConfig) -> dict[str, LinearShape]:
    """The fused linears' input width and sub-module output sizes for this model."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {"qkv": LinearShape(h, (q, kv, kv)), "o": LinearShape(q, (h,)),
            "gate_up": LinearShape(h, (inter, inter)), "down": LinearShape(inter, (h,))}


def check_target_modules(names: Sequence[str] | None) -> tuple[str, ...]:
    """The server's --lora-target-modules, validated, in SUPPORTED_TARGETS order (None: all of them)."""
    if names is None:
        return SUPPORTED_TARGETS
    unknown = [n for n in names if n not in SUPPORTED_TARGETS]
    if unknown or not names:
        raise ValueError(f"--lora-target-modules: {', '.join(unknown) or 'none given'} "
                         f"(supported: {', '.join(SUPPORTED_TARGETS)})")
    return tuple(m for m in SUPPORTED_TARGETS if m in names)


# ---------------------------------------------------------------- loading
def load_adapter(name: str, path: str | Path, model_config: ModelConfig, *, max_rank: int,
                 target_modules: Sequence[str] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """Read and validate the PEFT LoRA adapter in `path` for this base model, fused for one slot.

    `target_modules` is the server's allow-list (None: every supported module). Raises LoraError, having
    kept nothing, if anything is missing, malformed, unsupported or made for another base model.
    """
    if not name:
        raise LoraError("an adapter needs a non-empty name")
    config_bytes, weight_bytes = _read_files(name, Path(path))
    config = _parse_config(name, config_bytes)
    rank, scaling = _rank_and_scaling(name, config, max_rank)
    targets = _resolve_targets(name, config, model_config, check_target_modules(target_modules))
    try:
        tensors = load_safetensors(weight_bytes)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors is not a valid safetensors file "
                        f"({exc})") from None
    _check_tensors(name, tensors, targets, rank, model_config)
    weights = _fuse(tensors, targets, rank, scaling, model_config, dtype, device)
    touched = {m for _, m in targets}
    return LoraAdapter(name=name, path=str(path), rank=rank, scaling=scaling,
                       target_modules=tuple(m for m in SUPPORTED_TARGETS if m in touched),
                       version=hashlib.sha256(config_bytes + b"\0" + weight_bytes).hexdigest()[:16],
                       weights=weights)


def _read_files(name: str, directory: Path) -> tuple[bytes, bytes]:
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise AdapterNotFound(f"adapter {name!r}: {directory} {problem}")
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_path.is_file():
        raise AdapterNotFound(f"adapter {name!r}: no adapter_config.json in {directory}")
    if not weights_path.is_file():
        if (directory / "adapter_model.bin").exists():
            raise AdapterNotFound(f"adapter {name!r}: {directory} has adapter_model.bin, a pickle, which is not "
                                  "loaded; save the adapter as adapter_model.safetensors (PEFT's save_pretrained "
                                  "default)")
        raise AdapterNotFound(f"adapter {name!r}: no adapter_model.safetensors in {directory}")
    return config_path.read_bytes(), weights_path.read_bytes()


def _parse_config(name: str, config_bytes: bytes) -> dict[str, Any]:
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise LoraError(f"adapter {name!r}: adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    for key, feature in _UNSUPPORTED.items():
        if config.get(key):
            raise LoraError(f"adapter {name!r}: {feature} is not supported ({key} = {config[key]!r})")
    if config.get("fan_in_fan_out"):
        raise LoraError(f"adapter {name!r}: fan_in_fan_out (GPT-2 style Conv1D weights) is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')")
    return config


def _rank_and_scaling(name: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)  # 8: PEFT's default alpha
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"adapter {name!r}: rank r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoraError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _matches(spec: str | list[str], key: str) -> bool:
    """PEFT's rule: a string is a regex over the whole module name; a list entry names the module or its tail."""
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return any(key == entry or key.endswith("." + entry) for entry in spec)


def _resolve_targets(name: str, config: dict[str, Any], model_config: ModelConfig,
                     allowed: tuple[str, ...]) -> list[tuple[int, str]]:
    """The (layer, module) pairs the adapter changes, matched on module names as PEFT does."""
    spec, exclude = config.get("target_modules"), config.get("exclude_modules")
    if isinstance(spec, str) and spec.lower() == "all-linear":
        spec = list(SUPPORTED_TARGETS)
    for key, value in (("target_modules", spec), ("exclude_modules", exclude)):
        if value is not None and not (isinstance(value, str) or
                                      isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise LoraError(f"adapter {name!r}: {key} must be a list of module names or a regex, got {value!r}")
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as exc:
                raise LoraError(f"adapter {name!r}: {key} {value!r} is not a valid regex ({exc})") from None
    if not spec:
        raise LoraError(f"adapter {name!r}: adapter_config.json names no target_modules")
    candidates = {f"model.layers.{i}.{_PARENT[m]}.{m}": (i, m)
                  for i in range(model_config.num_layers) for m in SUPPORTED_TARGETS}
    outside = [key for key in _NOT_LAYERS if _matches(spec, key) and not (exclude and _matches(exclude, key))]
    if outside:
        raise LoraError(f"adapter {name!r}: targets {outside[0].split('.')[-1]}; only the decoder layers' "
                        f"linear modules can be adapted ({', '.join(SUPPORTED_TARGETS)})")
    if isinstance(spec, list):
        for entry in spec:
            if not any(_matches([entry], key) for key in candidates):
                raise LoraError(f"adapter {name!r}: unsupported target module {entry!r} "
                                f"(supported: {', '.join(SUPPORTED_TARGETS)})")
    targets = [pair for key, pair in candidates.items()
               if _matches(spec, key) and not (exclude and _matches(exclude, key))]
    targets = _honour_layers_to_transform(name, config, targets)
    if not targets:
        raise LoraError(f"adapter {name!r}: target_modules {spec!r} matches no module of this base model")
    modules = sorted({m for _, m in targets}, key=SUPPORTED_TARGETS.index)
    if model_config.moe is not None and any(m in MLP_TARGETS for m in modules):
        mlp = ", ".join(m for m in modules if m in MLP_TARGETS)
        raise LoraError(f"adapter {name!r}: targets {mlp}, but this is a Mixture-of-Experts model: LoRA on its "
                        "MLP is not supported (attention modules only)")
    refused = [m for m in modules if m not in allowed]
    if refused:
        raise LoraError(f"adapter {name!r}: targets {', '.join(refused)}, not in --lora-target-modules "
                        f"({', '.join(allowed)})")
    return targets


def _honour_layers_to_transform(name: str, config: dict[str, Any],
                                targets: list[tuple[int, str]]) -> list[tuple[int, str]]:
    layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if layers is None or layers == []:
        return targets
    if isinstance(config.get("target_modules"), str):
        raise LoraError(f"adapter {name!r}: layers_to_transform cannot be combined with a regex target_modules")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise LoraError(f"adapter {name!r}: layers_to_transform must be a layer index or a list of them, "
                        f"got {layers!r}")
    patterns = [pattern] if isinstance(pattern, str) else (pattern or [])
    if patterns and "layers" not in patterns:
        raise LoraError(f"adapter {name!r}: layers_pattern {pattern!r} does not name this model's layers ('layers')")
    return [(i, m) for i, m in targets if i in layers]


def _tensor_names(layer: int, module: str) -> tuple[str, str]:
    prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
    return prefix + ".lora_A.weight", prefix + ".lora_B.weight"


def _check_tensors(name: str, tensors: dict[str, torch.Tensor], targets: list[tuple[int, str]], rank: int,
                   model_config: ModelConfig) -> None:
    shapes = linear_shapes(model_config)
    expected: dict[str, tuple[int, int]] = {}
    for layer, module in targets:
        linear, j = _FUSED_OF[module]
        out, inp = shapes[linear].out_sizes[j], shapes[linear].in_features
        a_name, b_name = _tensor_names(layer, module)
        expected[a_name], expected[b_name] = (rank, inp), (out, rank)
    for key, shape in expected.items():
        if key in tensors and tuple(tensors[key].shape) != shape:
            raise LoraError(f"adapter {name!r}: tensor {key} has shape {list(tensors[key].shape)}, but this base "
                            f"model needs {list(shape)} (is the adapter for another base model?)")
    missing = [key for key in expected if key not in tensors]
    if missing:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors lacks {missing[0]}"
                        + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise LoraError(f"adapter {name!r}: unexpected tensor {unexpected[0]} in adapter_model.safetensors"
                        + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                        + f"; adapter_config.json targets {sorted({m for _, m in targets})}")
    for key in expected:
        tensor = tensors[key]
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise LoraError(f"adapter {name!r}: tensor {key} is not finite floating point ({tensor.dtype})")


def _fuse(tensors: dict[str, torch.Tensor], targets: list[tuple[int, str]], rank: int, scaling: float,
          model_config: ModelConfig, dtype: torch.dtype,
          device: torch.device | str) -> dict[tuple[int, str], LoraWeights]:
    shapes = linear_shapes(model_config)
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, module in targets:
        linear, j = _FUSED_OF[module]
        shape = shapes[linear]
        if (layer, linear) not in fused:
            fused[(layer, linear)] = (torch.zeros(len(shape.out_sizes) * rank, shape.in_features),
                                      torch.zeros(shape.out_offsets[-1], rank))
        a, b = fused[(layer, linear)]  # fp32 until the scaling is folded in
        a_name, b_name = _tensor_names(layer, module)
        lo, hi = shape.out_offsets[j], shape.out_offsets[j + 1]
        a[j * rank:(j + 1) * rank] = tensors[a_name].float()
        b[lo:hi] = tensors[b_name].float() * scaling
    return {key: LoraWeights(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            for key, (a, b) in sorted(fused.items())}


# ---------------------------------------------------------------- slots
class LoraPool:
    """The S adapter slots a batch can use: their tensors, and which adapter each holds.

    The tensors cover every layer and fused linear that the allowed target modules can touch (never a MoE
    model's MLP) and are never resized. `in_use` counts an adapter's running requests: `acquire` adds one,
    `release` takes it back; a slot with running requests is never evicted.
    """

    def __init__(self, model_config: ModelConfig, *, max_loras: int, max_rank: int,
                 target_modules: Sequence[str] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if max_loras < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {max_loras}")
        if max_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {max_rank}")
        self.model_config, self.max_rank, self.dtype, self.device = model_config, max_rank, dtype, device
        self.target_modules = check_target_modules(target_modules)
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [S], 0 for an empty slot
        self._layers: dict[tuple[int, str], LoraLayer] = {}
        for linear, shape in linear_shapes(model_config).items():
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
            n_sub = len(offsets) - 1
            lora_a[slot].view(n_sub, self.max_rank, -1)[:, :rank] = weights.a.view(n_sub, rank, -1)
            lora_b[slot, :, :rank] = weights.b
            self._touched[key] += 1
        self.ranks[slot] = rank
        self._adapters[slot] = adapter

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
