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
