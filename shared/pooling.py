"""How an embedding model turns hidden states into one vector per input, as its checkpoint says.

sentence-transformers checkpoints list their stages in `modules.json`: the transformer, a Pooling module
(whose `config.json` picks CLS, mean, max, mean/sqrt(len) or last-token pooling) and optionally Normalize.
A checkpoint without `modules.json` gets CLS pooling and normalisation. `dimensions` (Matryoshka
truncation) is allowed only where config.json declares the model was trained for it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

MODES = ("cls", "mean", "max", "mean_sqrt_len", "last")
_ST_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    mode: str  # one of MODES
    normalize: bool  # L2-normalise the pooled vector
    matryoshka: bool = False  # the first k dimensions (renormalised) are themselves an embedding
    matryoshka_dims: tuple[int, ...] = ()  # the k it was trained for; empty: any k

    @classmethod
    def from_dir(cls, path: str | Path) -> PoolingConfig:
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        dims = tuple(raw.get("matryoshka_dimensions") or ())
        matryoshka = bool(raw.get("is_matryoshka") or dims)
        modules_file = path / "modules.json"
        if not modules_file.exists():
            return cls("cls", True, matryoshka, dims)
        modules = json.loads(modules_file.read_text())
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        mode = "cls"
        pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        if pooling is not None:
            settings = json.loads((path / pooling.get("path", "") / "config.json").read_text())
            chosen = [m for flag, m in _ST_FLAGS.items() if settings.get(flag)]
            if "pooling_mode" in settings:  # newer sentence-transformers files name the mode directly
                chosen = [{"lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(
                    settings["pooling_mode"], settings["pooling_mode"])]
            if len(chosen) != 1 or chosen[0] not in MODES:
                raise ValueError(f"{path}: unsupported pooling settings {settings}")
            mode = chosen[0]
        return cls(mode, normalize, matryoshka, dims)


def pool(hidden: torch.Tensor, mask: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """One fp32 vector [B, H] per sequence of a padded batch `hidden` [B, T, H]; `mask` [B, T] marks real tokens."""
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).float()  # [B, T, 1]
    lengths = weights.sum(1).clamp(min=1.0)  # [B, 1]
    if config.mode == "cls":
        out = hidden[:, 0]
    elif config.mode == "last":
        out = hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    elif config.mode == "max":
        out = hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)
    else:
        total = (hidden * weights).sum(1)
        out = total / (lengths if config.mode == "mean" else lengths.sqrt())
    return torch.nn.functional.normalize(out, dim=-1) if config.normalize else out
