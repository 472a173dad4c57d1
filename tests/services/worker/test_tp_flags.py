"""What a worker refuses at start under --tp-size, each with its reason, before any rank process starts."""
from __future__ import annotations

import argparse

import pytest

from pdserve.services.worker.cli import add_arguments, runtime_config
from pdserve.services.worker.channel.settings import tp_ranks


def parse(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, command)
    return parser.parse_args(list(argv))


def test_the_alias_and_the_default():
    assert parse("colocated").tp_size == 1
    assert parse("colocated", "--tensor-parallel-size", "2").tp_size == 2


def test_tp_size_one_starts_no_ranks(tiny_models):
    args = parse("colocated", "--model-path", str(tiny_models["llama"]))
    assert tp_ranks(args, runtime_config(args, args.model_path), None) is None


def test_the_storage_tier_is_split_across_ranks_and_the_host_tier_refused_with_the_reason(tiny_models, tmp_path):
    from dataclasses import replace

    from pdserve.shared.model_runner import _check_tp_features

    args = parse("colocated", "--model-path", str(tiny_models["llama"]), "--enable-hierarchical-cache",
                 "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path))
    config = runtime_config(args, args.model_path)
    _check_tp_features(config)  # each rank stores its own KV heads (kv_tier_ranks.py)
    host = replace(config, tiers=replace(config.tiers, host_ratio=2.0))
    with pytest.raises(ValueError, match="--tp-size > 1 does not work with --hicache-ratio / --hicache-size"):
        _check_tp_features(host)


# ------------------------------------------------------------------------------------------------ across nodes
def nodes_of(*argv: str, environ: dict | None = None):
    from pdserve.shared.tp_nodes import plan_nodes

    args = parse("colocated", *argv)
    return plan_nodes(args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr, environ or {})


def test_one_node_by_default():
    args = parse("colocated", "--tp-size", "2")
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (1, 0, None)
    assert nodes_of("--tp-size", "2") is None


def test_each_node_holds_an_even_run_of_ranks_and_meets_at_the_address():
    nodes = nodes_of("--tp-size", "8", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.1.2.3:20000")
    assert (nodes.host, nodes.port, nodes.per_node) == ("10.1.2.3", 20000, 4)
    assert list(nodes.local) == [4, 5, 6, 7]
    assert nodes_of("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "tcp://[fd00::1]:29500").host == "fd00::1"


def test_the_platforms_master_address_is_the_fallback():
    env = {"MASTER_ADDR": "leader.pd.svc", "MASTER_PORT": "29500"}
    nodes = nodes_of("--tp-size", "2", "--nnodes", "2", "--node-rank", "1", environ=env)
    assert (nodes.host, nodes.port) == ("leader.pd.svc", 29500)
    flag = nodes_of("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.9:1234", environ=env)
    assert (flag.host, flag.port) == ("10.0.0.9", 1234)  # the flag wins


@pytest.mark.parametrize("argv,environ,message", [
    (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "h:1"], {},
     "--node-rank 2 is not a node of --nnodes 2 (nodes are numbered 0 to 1)"),
    (["--node-rank", "1", "--tp-size", "2"], {}, "--node-rank 1 is not a node of --nnodes 1"),
    (["--nnodes", "2", "--tp-size", "2"], {}, "--nnodes 2 needs the address where the ranks meet: "
                                             "--dist-init-addr HOST:PORT"),
    (["--nnodes", "2", "--tp-size", "2"], {"MASTER_ADDR": "h"}, "MASTER_ADDR=h is set but MASTER_PORT is not"),
    (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "h:1"], {},
     "--tp-size 3 does not spread evenly over --nnodes 2"),
    (["--nnodes", "4", "--tp-size", "2", "--dist-init-addr", "h:1"], {},
     "--tp-size 2 does not spread evenly over --nnodes 4"),
    (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "h"], {}, "--dist-init-addr 'h' is not HOST:PORT"),
    (["--nnodes", "0"], {}, "--nnodes must be at least 1, got 0"),
])
def test_flags_that_cannot_go_together_are_start_errors_naming_the_numbers(argv, environ, message):
    with pytest.raises(ValueError) as info:
        nodes_of(*argv, environ=environ)
    assert message in str(info.value)


def test_the_worker_refuses_them_before_anything_starts(tiny_models, capsys, monkeypatch):
    from pdserve.services.worker import cli

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(cli, "setup_logging", lambda *a, **k: None)  # (its handler would outlive capsys)
    args = parse("colocated", "--model-path", str(tiny_models["llama"]), "--tp-size", "2", "--nnodes", "2")
    assert cli.main(args, "colocated") == 1
    assert "error: --nnodes 2 needs the address where the ranks meet" in capsys.readouterr().err
