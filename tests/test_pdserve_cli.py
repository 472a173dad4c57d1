"""The `pdserve` command itself: --version, and the flags of a service read from --config FILE."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from pdserve import cli


def parse(*argv: str):
    """What `pdserve ARGV` runs with (as cli.main parses it)."""
    argv = list(argv)
    parser, command, command_parser = cli._build(argv)
    return parser.parse_args(cli.with_config_file(argv, command, command_parser))


def test_version_prints_the_package_version():
    result = subprocess.run([sys.executable, "-m", "pdserve", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == f"pdserve {version('pdserve')}"


WORKER_TOML = """
context-length = 1024
max_running_requests = 7          # underscores work too
mem-fraction-static = 0.5         # SGLang's name
enable-mixed-chunk = true
schedule-policy = "lpm"
lora-paths = ["a=/tmp/a", "b=/tmp/b"]
log-format = "json"
"""

WORKER_YAML = """
context_length: 1024
max-running-requests: 7
mem-fraction-static: 0.5
enable-mixed-chunk: true
schedule-policy: lpm
lora-paths: [a=/tmp/a, b=/tmp/b]
log-format: json
"""


@pytest.mark.parametrize("name, text", [("worker.toml", WORKER_TOML), ("worker.yaml", WORKER_YAML)])
def test_a_config_file_sets_a_workers_flags_and_the_command_line_wins(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    args = parse("colocated", "--config", str(path), "--max-running-requests", "3", "--lora-paths", "c=/tmp/c")
    assert (args.context_length, args.mem_fraction, args.enable_mixed_chunk, args.schedule_policy,
            args.log_format) == (1024, 0.5, True, "lpm", "json")
    assert args.max_running_requests == 3 and args.lora_paths == ["c=/tmp/c"]  # given on the command line
    assert parse("colocated", "--config", str(path)).lora_paths == ["a=/tmp/a", "b=/tmp/b"]


def test_a_config_file_sets_repeatable_gateway_flags(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text('prefill = ["127.0.0.1:1", "127.0.0.1:2"]\ndecode = "127.0.0.1:3"\nlog-requests = true\n'
                    'max-queued-requests = 0\n')
    args = parse("gateway", "--config", str(path))
    assert args.prefill == ["127.0.0.1:1", "127.0.0.1:2"] and args.decode == ["127.0.0.1:3"]
    assert args.log_requests is True and args.max_queued_requests == 0


def test_up_reads_the_flags_it_passes_through_from_a_config_file(tmp_path):
    path = tmp_path / "up.toml"
    path.write_text('colocated = true\npage-size = 32\nreasoning-parser = "qwen3"\nport = 31000\n')
    args = parse("up", "--config", str(path), "--port", "31001")
    assert (args.colocated, args.page_size, args.reasoning_parser, args.port) == (True, 32, "qwen3", 31001)


@pytest.mark.parametrize("name, text, message", [
    ("c.toml", "no-such-flag = 1\n", "'no-such-flag' is not a flag of `pdserve colocated`"),
    ("c.toml", "enable-mixed-chunk = 1\n", "--enable-mixed-chunk is a switch: give true or false"),
    ("c.toml", "page-size = [1, 2]\n", "--page-size takes one value, not a list"),
    ("c.toml", "page-size = \n", "Invalid value"),
    ("c.yaml", "- a list\n", "expected flag names and their values at the top level"),
    ("c.ini", "page-size = 1\n", "give a .toml, .yaml or .yml file"),
])
def test_a_bad_config_file_is_one_clear_line(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    assert cli.main(["colocated", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {path}: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_config_value_the_flag_refuses_is_refused_as_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('schedule-policy = "random"\n')
    with pytest.raises(SystemExit) as exit_info:
        parse("colocated", "--config", str(path))
    assert exit_info.value.code == 2
    assert "argument --schedule-policy: invalid choice: 'random'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["jobs", "--batch-workers", "-1"], ["jobs", "--lease-seconds", "0"],
                                  ["gateway", "--max-queued-requests", "-1"]])
def test_services_print_their_errors_to_stderr(argv):
    result = subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stdout == "" and result.stderr.startswith("error:"), (result.stdout, result.stderr)
