"""The KV tier flags (SGLang's `--enable-hierarchical-cache`, `--hicache-*`): what TierConfig they build, and every
configuration the worker cannot serve refused at start, by a real worker process, naming the flag and the reason."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.services.worker import cli
from pdserve.shared.config import TierConfig

ENABLE = ("--enable-hierarchical-cache", "--hicache-storage-backend", "file")


def config_of(*argv: str, command: str = "colocated"):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser, command)
    return cli.runtime_config(parser.parse_args(list(argv)), "model")


def test_off_by_default_on_every_generative_role(tmp_path):
    for command in ("colocated", "prefill", "decode"):
        assert config_of(command=command).tiers is None
    # decode computes a conversation's next turn itself: it reads that prefix from the tier too
    assert config_of(*ENABLE, "--hicache-storage-dir", str(tmp_path), command="decode").tiers.storage_dir == str(tmp_path)


def test_flags_build_the_tier_with_defaults_for_what_is_not_given(tmp_path):
    assert config_of(*ENABLE, "--hicache-storage-dir", str(tmp_path)).tiers == TierConfig(
        str(tmp_path), write_policy="write_through", prefetch_policy="best_effort", prefetch_timeout_s=2.0)
    tiers = config_of(*ENABLE, "--hicache-storage-dir", str(tmp_path), "--hicache-write-policy", "write_back",
                      "--hicache-storage-prefetch-policy", "timeout", "--hicache-storage-prefetch-timeout", "0.25",
                      command="prefill").tiers
    assert (tiers.write_policy, tiers.prefetch_policy, tiers.prefetch_timeout_s) == ("write_back", "timeout", 0.25)


def test_a_gpu_worker_gets_the_host_tier_as_sglang_does(tmp_path):
    # --enable-hierarchical-cache alone: host memory at twice the pool, SGLang's default
    assert config_of("--enable-hierarchical-cache", "--device", "cuda").tiers == TierConfig(host_ratio=2.0)
    assert config_of("--enable-hierarchical-cache", "--device", "cuda", "--hicache-size", "40").tiers == \
        TierConfig(host_gb=40.0)
    both = config_of(*ENABLE, "--hicache-storage-dir", str(tmp_path), "--device", "cuda", "--hicache-ratio", "3",
                     "--hicache-write-policy", "write_back", command="prefill").tiers
    assert (both.host_ratio, both.storage_dir, both.write_policy) == (3.0, str(tmp_path), "write_back")
    # a CPU worker's tier is storage only
    assert config_of(*ENABLE, "--hicache-storage-dir", str(tmp_path)).tiers.host_ratio is None


@pytest.mark.parametrize("argv, message", [
    (("--enable-hierarchical-cache",), "on a CPU worker: its tier is storage, so it needs --hicache-storage-backend "
                                       "file and --hicache-storage-dir DIR"),
    (ENABLE, "--hicache-storage-backend file needs --hicache-storage-dir"),
    (("--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--hicache-storage-dir", "/d"),
     "--hicache-storage-backend must be one of file, got 'mooncake' (mooncake is not built)"),
    (("--hicache-storage-dir", "/d"), "--hicache-storage-dir needs --enable-hierarchical-cache"),
    (("--hicache-write-policy", "write_back"), "--hicache-write-policy needs --enable-hierarchical-cache"),
    ((*ENABLE, "--hicache-storage-dir", "/d", "--hicache-storage-prefetch-timeout", "0"),
     "--hicache-storage-prefetch-timeout must be > 0"),
    (("--hicache-ratio", "2"), "--hicache-ratio sizes the host-memory KV tier, which a CPU worker has no use "
                               "for: its KV pool already lives in host memory"),
    (("--hicache-ratio", "2", "--device", "cuda"), "--hicache-ratio needs --enable-hierarchical-cache"),
    (("--enable-hierarchical-cache", "--device", "cuda", "--hicache-ratio", "2", "--hicache-size", "8"),
     "--hicache-ratio and --hicache-size both size the host-memory tier: give one"),
    (("--enable-hierarchical-cache", "--device", "cuda", "--hicache-ratio", "0.5"), "--hicache-ratio must be >= 1"),
    (("--enable-hierarchical-cache", "--device", "cuda", "--hicache-size", "0"), "--hicache-size must be > 0 GB"),
    (("--enable-hierarchical-cache", "--device", "cuda", "--hicache-write-policy", "write_back"),
     "--hicache-write-policy applies to the storage tier, which needs --hicache-storage-backend file"),
    (("--enable-hierarchical-cache", "--device", "cuda", "--hicache-storage-dir", "/d"),
     "--hicache-storage-dir applies to the storage tier"),
    ((*ENABLE, "--hicache-storage-dir", "/d", "--is-embedding"), "does not apply to an embedding worker"),
])
def test_what_cannot_be_served_is_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError) as refused:
        config_of(*argv)
    assert message in str(refused.value)


# ---------------------------------------------------------------- real worker processes


def run_worker(*args: str, command: str = "colocated") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", command, "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_directory_that_cannot_be_created_stops_the_worker_before_the_model_loads(tmp_path, tiny_models):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = run_worker("--model-path", str(tiny_models["llama"]), *ENABLE, "--hicache-storage-dir",
                   str(blocker / "kv"), command="prefill")
    assert r.returncode == 1
    assert r.stderr.startswith(f"error: --hicache-storage-dir {str(blocker / 'kv')!r} cannot be used: ")
    assert "Traceback" not in r.stderr and "loading" not in r.stderr.lower()


def test_the_host_memory_tier_on_a_cpu_worker_is_a_start_error(tiny_models):
    r = run_worker("--model-path", str(tiny_models["llama"]), "--enable-hierarchical-cache", "--hicache-ratio", "2")
    assert r.returncode == 1
    assert r.stderr.strip().startswith("error: --hicache-ratio sizes the host-memory KV tier")
    assert "already lives in host memory" in r.stderr and "Traceback" not in r.stderr


def test_an_encoder_worker_refuses_the_tier(tmp_path, minilm_dir):
    r = run_worker("--model-path", str(minilm_dir), *ENABLE, "--hicache-storage-dir", str(tmp_path / "kv"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "error: --enable-hierarchical-cache does not apply to an embedding worker" in r.stderr


def test_storage_bounds_from_the_flags_else_sglangs_environment(tmp_path, monkeypatch):
    storage = (*ENABLE, "--hicache-storage-dir", str(tmp_path))
    tiers = config_of(*storage, "--hicache-storage-max-size", "200GB", "--hicache-storage-min-free-space", "500MB",
                      "--hicache-storage-eviction-ratio", "0.8", "--hicache-storage-group-access").tiers
    assert (tiers.storage_max_bytes, tiers.storage_min_free_bytes, tiers.storage_eviction_ratio,
            tiers.storage_group_access) == (200 * 10**9, 500 * 10**6, 0.8, True)
    plain = config_of(*storage).tiers
    assert (plain.storage_max_bytes, plain.storage_min_free_bytes, plain.storage_eviction_ratio,
            plain.storage_group_access) == (0, 0, 0.9, False)
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "2Gi")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE", "10G")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO", "0.5")
    env = config_of(*storage).tiers
    assert (env.storage_max_bytes, env.storage_min_free_bytes, env.storage_eviction_ratio) == (2 * 2**30, 10**10, 0.5)
    assert config_of(*storage, "--hicache-storage-max-size", "64MB").tiers.storage_max_bytes == 64 * 10**6


@pytest.mark.parametrize("argv, env, message", [
    (("--hicache-storage-max-size", "lots"), {}, "--hicache-storage-max-size must be a size"),
    ((), {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "200X"}, "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE must be a size"),
    (("--hicache-storage-eviction-ratio", "1.5"), {}, r"--hicache-storage-eviction-ratio must be a number in \(0, 1\]"),
    (("--hicache-storage-min-free-space=-3G",), {}, "--hicache-storage-min-free-space must be a size"),
])
def test_a_bound_that_cannot_be_read_is_a_start_error(tmp_path, monkeypatch, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        config_of(*ENABLE, "--hicache-storage-dir", str(tmp_path), *argv)


def test_storage_bounds_need_the_storage_tier():
    with pytest.raises(ValueError, match="--hicache-storage-max-size needs --enable-hierarchical-cache"):
        config_of("--hicache-storage-max-size", "1GB")
