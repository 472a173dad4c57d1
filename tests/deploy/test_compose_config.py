"""compose.yaml hands every service a flags file (config/<service>.toml, mounted read-only): each exists, and
its example lines, once uncommented, are flags the service's `pdserve` command takes (read as `--config` is)."""
from __future__ import annotations

from pathlib import Path

import pytest

from deploy_tools import REPO
from pdserve import cli
from test_compose import config, flag

SERVICES = ("prefill", "decode", "prefill-gpu", "decode-gpu", "embedding", "jobs", "gateway")


@pytest.fixture(scope="module")
def services(compose_binary) -> dict:
    return config(compose_binary, "gpu", "embedding")["services"]


@pytest.mark.parametrize("name", SERVICES)
def test_each_service_reads_its_flags_file(services, name, tmp_path):
    service = services[name]
    [path] = flag(service["command"], "--config")
    mount = [v for v in service["volumes"] if v["target"] == "/etc/pdserve"]
    assert len(mount) == 1 and mount[0].get("read_only") and Path(mount[0]["source"]) == REPO / "config", mount
    local = REPO / "config" / Path(path).name
    assert local.is_file(), local
    # The examples, uncommented, are accepted as that command's flags.
    examples = [line.removeprefix("# ") for line in local.read_text().splitlines()
                if line.startswith("# ") and " = " in line]
    assert examples, f"{local} shows no example"
    trial = tmp_path / local.name
    trial.write_text("\n".join(examples) + "\n")
    argv = [service["command"][0], *[str(trial) if a == path else a for a in service["command"][1:]]]
    parser, command, command_parser = cli._build(argv)
    expanded = cli.with_config_file(argv, command, command_parser)
    assert len(expanded) == len(argv) + len(examples)  # one --flag=value each
    parser.parse_args(expanded)
