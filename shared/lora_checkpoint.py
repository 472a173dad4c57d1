"""PEFT LoRA checkpoints read, checked against the base model and the server's limits, and fused for one slot.

`load_adapter` reads a PEFT directory (adapter_config.json + adapter_model.safetensors) and either returns a
`LoraAdapter` whose weights are laid out like the model's fused linears (q|k|v, gate|up; the layout is in
lora.py) or raises `LoraError` having kept nothing: a half-checked adapter never reaches a slot. Module names are
matched as PEFT matches them, so an adapter changes here exactly what it changed where it was trained.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load as load_safetensors

from pdserve.shared.config import ModelConfig
from pdserve.shared.lora import (FUSED_LINEARS, SUPPORTED_TARGETS, AdapterNotFound, LoraAdapter, LoraError,
                                 LoraWeights, check_target_modules, linear_shapes)

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
