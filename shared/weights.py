"""Live weight updates: a checkpoint read and checked against the running model before anything changes.

A checkpoint can replace the running weights when its config.json describes the same architecture and sizes
and it holds every tensor the running model was loaded from, with the same shape, as floating-point values.
The lifecycle of one update on a worker:

    read_checkpoint (any thread, file I/O)  ->  ModelRunner.build_weights (engine thread, beside the running
    model)  ->  ServedWeights.commit (shared/admin.py, engine thread, between two steps, once no request runs)

Every check runs before the last step, so a refusal names the tensor or config field at fault and the running
model is exactly what it was.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.shared.config import ModelConfig
from pdserve.shared.model_files import ModelNotFound, resolve_model_path

log = logging.getLogger(__name__)

# ModelConfig fields a checkpoint may change: none of them shapes a tensor, the KV cache or the rotary table.
# (The stop tokens stay the running model's: the gateway's tokenizer and templates do not change either.)
FREE_FIELDS = frozenset({"path", "torch_dtype", "eos_token_ids"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors' names
MAX_LISTED = 3  # problems named in one error; the rest are counted


class WeightsError(ValueError):
    """The checkpoint cannot replace the running weights; nothing changed."""


class CheckpointNotFound(WeightsError):
    """The path names no checkpoint at all."""


@dataclass
class Checkpoint:
    source: str  # the path as given
    directory: Path  # the HF directory it resolved to
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor as saved (CPU, the file's dtype)


@dataclass(frozen=True)
class _Entry:
    file: Path
    name: str  # in the file
    shape: tuple[int, ...]
    dtype: str


def read_checkpoint(model_path: str, running: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> Checkpoint:
    """The tensors of `model_path` that a model of config `running`, loaded from tensors of `shapes`, takes.

    File I/O only (no compute), so any thread may run it. Raises CheckpointNotFound for a path that names no
    checkpoint, WeightsError for a checkpoint that does not fit."""
    directory = locate(model_path)
    try:
        config = ModelConfig.from_dir(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise WeightsError(f"cannot read {directory / 'config.json'}: {exc}") from None
    check_config(config, running)
    headers = read_headers(directory)
    check_tensors(headers, shapes, directory)
    return Checkpoint(model_path, directory, read_tensors(headers, shapes))


def locate(model_path: str) -> Path:
    """The HF directory of `model_path` (a GGUF file is converted once, as at start-up)."""
    try:
        return resolve_model_path(model_path, quiet=True)
    except ModelNotFound as exc:
        # SGLang's words for a name that is neither here nor a repository it could fetch, and the same words
        # whatever the path is (missing, a file, a folder without a checkpoint): an API caller learns nothing
        # of the host's files. The worker's log says which.
        log.warning("weights from %s: %s", model_path, exc)
        raise CheckpointNotFound(f"{model_path} (repository not found)") from None
    except Exception as exc:  # a GGUF file transformers cannot convert
        raise WeightsError(f"cannot convert {model_path}: {exc}") from None


def check_config(new: ModelConfig, running: ModelConfig) -> None:
    for f in fields(ModelConfig):
        if f.name in FREE_FIELDS:
            continue
        mine, theirs = getattr(running, f.name), getattr(new, f.name)
        if mine != theirs:
            raise WeightsError(f"the checkpoint's {f.name} is {theirs!r}, the running model's is {mine!r}: only "
                               "a checkpoint of the same architecture and size can replace the running weights")


def read_headers(directory: Path) -> dict[str, _Entry]:
    """Every tensor's file, shape and dtype, from the files' headers alone (no tensor data read), by the name
    LlamaForCausalLM.load takes it under."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {directory}")
    entries: dict[str, _Entry] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    entries[name] = _Entry(path, name, tuple(view.get_shape()), view.get_dtype())
        except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
            raise WeightsError(f"cannot read {path}: {exc}") from None
    if "model.embed_tokens.weight" not in entries and "embed_tokens.weight" in entries:
        entries = {f"model.{name}": entry for name, entry in entries.items()}  # a bare decoder, as load() renames
    return entries


def check_tensors(headers: dict[str, _Entry], shapes: dict[str, tuple[int, ...]], directory: Path) -> None:
    problems = []
    for name, shape in shapes.items():
        entry = headers.get(name)
        if entry is None:
            problems.append(f"tensor {name!r} is missing from {directory}")
        elif entry.shape != tuple(shape):
            problems.append(f"tensor {name!r} has shape {list(entry.shape)} in {entry.file}, the running "
                            f"model's has {list(shape)}")
        elif entry.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name!r} in {entry.file} holds {entry.dtype}, not floating-point values")
    if problems:
        more = len(problems) - MAX_LISTED
        raise WeightsError("; ".join(problems[:MAX_LISTED]) + (f" (and {more} more problems)" if more > 0 else ""))


def read_tensors(headers: dict[str, _Entry], names) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(headers[name].file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        name = None
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in file_names:
                    tensors[name] = f.get_tensor(headers[name].name)
        except Exception as exc:  # the header was fine, the data is not
            raise WeightsError(f"cannot read tensor {name!r} from {path}: {exc}") from None
    return tensors


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """A NaN or infinity in a weight is a damaged file (or a diverged training run), never a model to serve.

    Compute: call it on the engine thread (see compute_thread.py)."""
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise WeightsError(f"tensor {name!r} holds NaN or infinite values")
