"""`--kernels` picks the kernel set a worker runs; `--attention-backend` (SGLang's name) is the same flag.

Either spelling, on the command line, in a `--config` file or given to `pdserve up`, reaches the runtime
config as the one setting `RuntimeConfig.kernels`; the worker's Info reports the set it runs as `kernels`."""
from __future__ import annotations

import argparse

import pytest

from pdserve import cli
from pdserve.proto import worker_pb2 as pb
from pdserve.services import up, up_plan
from pdserve.services.worker import cli as worker_cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser, _ = cli.build_parser(argv)
    return parser.parse_args(argv)


@pytest.mark.parametrize("command", ["colocated", "prefill", "decode"])
@pytest.mark.parametrize("spelling", ["--kernels", "--attention-backend"])
def test_both_spellings_pick_the_kernel_set(command, spelling):
    args = parse([command, spelling, "torch"])
    assert args.kernels == "torch"
    assert worker_cli.runtime_config(args, "/models/m").kernels == "torch"
    assert parse([command]).kernels == "auto"


def test_the_help_names_what_the_flag_picks(capsys):
    with pytest.raises(SystemExit):
        parse(["colocated", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--kernels {auto,native,torch,triton}, --attention-backend {auto,native,torch,triton}" in help_text
    assert "the kernel set every layer runs on" in help_text


@pytest.mark.parametrize("spelling", ["--kernels", "--attention-backend"])
def test_an_unknown_kernel_set_is_refused_with_the_choices(spelling, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["colocated", spelling, "cuda"])
    assert exit_.value.code == 2
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["kernels", "attention-backend", "attention_backend"])
def test_a_config_file_takes_either_name(tmp_path, key):
    config = tmp_path / "worker.toml"
    config.write_text(f'{key} = "torch"\n')
    argv = ["colocated", "--config", str(config)]
    parser, command, command_parser = cli._build(argv)
    args = parser.parse_args(cli.with_config_file(argv, command, command_parser))
    assert args.kernels == "torch"


@pytest.mark.parametrize("spelling", ["--kernels", "--attention-backend"])
def test_up_passes_either_spelling_to_every_worker(tmp_path, spelling):
    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "up")
    plan = up_plan.build_plan(parser.parse_args([spelling, "torch", "--state-dir", str(tmp_path)]), tmp_path / "m",
                              cpus=2)
    workers = [s for s in plan.services if s.args[0] in ("prefill", "decode", "colocated")]
    assert workers
    for service in workers:
        assert parse(service.args).kernels == "torch"
    gateway = next(s for s in plan.services if s.args[0] == "gateway")
    assert "--kernels" not in gateway.args and "--attention-backend" not in gateway.args


def test_info_reports_the_kernel_set_in_the_field_it_always_had():
    """Info's `kernels` is field 10, where older workers and gateways put `attention_backend`: they still agree."""
    wire = pb.InfoReply(kernels="native").SerializeToString()
    assert wire == bytes([10 << 3 | 2, len("native")]) + b"native"  # field 10, length-delimited
    assert pb.InfoReply.FromString(wire).kernels == "native"
