"""A worker started with a bad model or bad flags says what is wrong in one line and exits non-zero."""
from __future__ import annotations

import subprocess
import sys


def run_worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "colocated", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)


def test_missing_model_path_is_one_clear_line(tmp_path):
    r = run_worker("--model-path", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: model path {str(tmp_path / 'nope')!r} does not exist "
                                             "(expected an HF directory, a .gguf file, or a model id such as "
                                             "Qwen/Qwen2.5-0.5B-Instruct already in the local Hugging Face cache)"]


def test_directory_without_config_is_refused(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    r = run_worker("--model-path", str(tmp_path))
    assert r.returncode == 1
    assert "has no config.json" in r.stderr and "Traceback" not in r.stderr


def test_corrupt_weights_are_refused_without_traceback(tmp_path, tiny_models):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    (bad / "tokenizer.json").write_text("{}")
    r = run_worker("--model-path", str(bad))
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_invalid_cache_flags_name_the_flag(tiny_models):
    r = run_worker("--model-path", str(tiny_models["llama"]), "--page-size", "0")
    assert r.returncode == 1 and "--page-size must be >= 1" in r.stderr


def test_unknown_quantization_names_the_choices(tiny_models):
    r = run_worker("--model-path", str(tiny_models["llama"]), "--quantization", "fp8")
    assert r.returncode == 2 and "invalid choice: 'fp8'" in r.stderr and "w8a8_int8" in r.stderr
