"""What --model-path accepts: an HF directory, a .gguf file, or a model id from the local Hugging Face cache
(offline, nothing downloaded); anything else is a clear error."""
from __future__ import annotations

import shutil

import pytest

from pdserve.shared.model_files import ModelNotFound, resolve_model_path


def fake_hub_cache(root, model_id: str, source) -> None:
    """Lay `source` out as huggingface_hub caches a download: models--org--name/{refs/main, snapshots/<rev>}."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(source, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_a_model_id_resolves_to_its_snapshot_in_the_local_hub_cache(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, "tiny-org/tiny-qwen3", tiny_models["qwen3"])
    path = resolve_model_path("tiny-org/tiny-qwen3", quiet=True)
    assert path.parent.name == "snapshots" and (path / "config.json").exists()


def test_an_unknown_id_or_path_names_what_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    for name in ("tiny-org/not-cached", str(tmp_path / "nowhere"), "../no-such-org/no-such-model"):
        with pytest.raises(ModelNotFound, match="local Hugging Face cache"):
            resolve_model_path(name, quiet=True)


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match="no \\*.safetensors"):
        resolve_model_path(str(tmp_path), quiet=True)
