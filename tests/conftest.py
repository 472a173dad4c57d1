from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run only in the interpreter; it must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: HF directory} of tiny random checkpoints (see fixtures.py)."""
    from fixtures import ARCHS, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def default_model_dir():
    from pdserve.shared.model_files import resolve_model_path

    return resolve_model_path(None, quiet=True)


@pytest.fixture(scope="session")
def minilm_dir():
    """all-MiniLM-L6-v2, prepared by scripts/setup: missing, it fails the tests that need it (never skips)."""
    from pdserve.shared.model_files import resolve_model_path

    return resolve_model_path("all-MiniLM-L6-v2")


# Seeded PEFT adapters for the default model: ranks, target sets and scalings that differ on purpose.
DEFAULT_MODEL_ADAPTERS = {
    "sql": dict(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], alpha=16, seed=1),
    "poet": dict(rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"], alpha=16, seed=2, use_rslora=True, std=0.02),
    "terse": dict(rank=4, target_modules=["v_proj", "up_proj", "down_proj"], alpha=8, seed=3),
}


@pytest.fixture(scope="session")
def default_model_adapters(default_model_dir, tmp_path_factory) -> dict[str, Path]:
    """{name: PEFT directory} of DEFAULT_MODEL_ADAPTERS, saved by PEFT itself."""
    from lora_adapters import make_peft_adapter

    root = tmp_path_factory.mktemp("lora-adapters")
    return {name: make_peft_adapter(default_model_dir, root / name, **spec)
            for name, spec in DEFAULT_MODEL_ADAPTERS.items()}
