"""What a worker refuses at start under --tp-size, each with its reason, before any rank process starts."""
from __future__ import annotations

import argparse

import pytest

from pdserve.services.worker.cli import add_arguments, runtime_config
from pdserve.services.worker.settings import tp_ranks
from pdserve.shared.config import ModelConfig, Role
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.tp_step import TPRank
from pdserve.shared.tp_shards import Shards


def parse(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, command)
    return parser.parse_args(list(argv))


def test_the_alias_and_the_default():
    assert parse("colocated").tp_size == 1
    assert parse("colocated", "--tensor-parallel-size", "2").tp_size == 2


def test_tp_size_one_starts_no_ranks(tiny_models):
    args = parse("colocated", "--model-path", str(tiny_models["llama"]))
    assert tp_ranks(args, runtime_config(args, args.model_path), Role.COLOCATED) is None


@pytest.mark.parametrize("flags,reason", [
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file"], "--enable-hierarchical-cache"),
])
def test_features_not_split_yet_are_refused_with_the_reason(tiny_models, tmp_path, flags, reason):
    extra = ["--hicache-storage-dir", str(tmp_path)] if "--enable-hierarchical-cache" in flags else []
    args = parse("colocated", "--model-path", str(tiny_models["llama"]), *flags, *extra)
    config = runtime_config(args, args.model_path)
    shards = Shards.plan(ModelConfig.from_dir(args.model_path), 0, 2)
    with pytest.raises(ValueError, match=f"--tp-size > 1 does not work with {reason}"):
        ModelRunner(config, tp=TPRank(shards, box=None, group=None))
