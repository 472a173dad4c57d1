"""`pdserve up --embedding-model PATH`: a dedicated embedding worker beside the generative ones, wired to the
gateway (pure plan checks; the routing itself is tested in tests/services/gateway/test_multi_model.py)."""
from __future__ import annotations

import argparse

from pdserve import cli
from pdserve.services import up, up_plan


def plan(tmp_path, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "up")
    args = parser.parse_args([*argv, "--state-dir", str(tmp_path / "state")])
    return {s.name: s for s in up_plan.build_plan(args, tmp_path, cpus=4).services}


def test_embedding_worker_is_planned_and_routed_to(tmp_path):
    for argv in (("--colocated",), ("--prefill", "2", "--decode", "1")):
        services = plan(tmp_path, *argv, "--embedding-model", "all-MiniLM-L6-v2")
        worker = services["embedding"]
        parser, command = cli.build_parser(worker.args)
        parsed = parser.parse_args(worker.args)
        assert command == "colocated" and parsed.is_embedding and parsed.model_path == "all-MiniLM-L6-v2"
        assert parsed.http_port == parsed.port + 1000 and worker.health_url.endswith(f"{parsed.port + 1000}/health")
        gateway = cli.build_parser(services["gateway"].args)[0].parse_args(services["gateway"].args)
        assert gateway.embedding_model == "all-MiniLM-L6-v2"
        assert gateway.embedding_worker == [f"127.0.0.1:{parsed.port}"]
        planned = [u.port for s in services.values() for u in s.ports]
        assert len(planned) == len(set(planned))  # no port planned twice


def test_no_embedding_worker_unless_asked(tmp_path):
    services = plan(tmp_path, "--colocated")
    assert "embedding" not in services and "--embedding-model" not in services["gateway"].args


def test_embedding_quantization_reaches_only_the_embedding_worker(tmp_path):
    services = plan(tmp_path, "--colocated", "--embedding-model", "all-MiniLM-L6-v2",
                    "--embedding-quantization", "w8a8_int8")
    parsed = {name: cli.build_parser(s.args)[0].parse_args(s.args) for name, s in services.items()
              if name in ("embedding", "colocated")}
    assert parsed["embedding"].quantization == "w8a8_int8"
    assert parsed["colocated"].quantization is None


def test_quantization_reaches_the_generative_workers_only(tmp_path):
    services = plan(tmp_path, "--embedding-model", "all-MiniLM-L6-v2", "--quantization", "w8a8_int8")
    parsed = {name: cli.build_parser(s.args)[0].parse_args(s.args) for name, s in services.items()
              if name in ("embedding", "prefill", "decode")}
    assert parsed["prefill"].quantization == parsed["decode"].quantization == "w8a8_int8"
    assert parsed["embedding"].quantization is None  # its own flag: --embedding-quantization
