"""The documentation site builds with no broken link or missing page, and its references miss nothing.

The site is built once, as a user builds it (`mkdocs build --strict` from the project's venv). What the references
must hold is read here from the code by other routes than the generators in docs/gen/ take: the flags from each
command parser's own table of options, the metric names from the string literals of the modules that use
prometheus_client, the Helm values from values.yaml, the error statuses from the `ApiError(...)` calls' text, the sampling
parameters from their dataclass.
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.cli import COMMANDS, _build

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    assert "WARNING" not in run.stderr, run.stderr
    return out


def page(site: Path, path: str) -> str:
    return html.unescape((site / path / "index.html").read_text())


def flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Subcommand ('' for the command itself) -> every flag its --help shows."""
    out = {"": {option for option, action in parser._option_string_actions.items()
                if option.startswith("--") and action.help != argparse.SUPPRESS and option != "--help"}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = flags(sub)[""]
    return out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_of_every_command_is_in_its_reference_page(site, command):
    text = page(site, f"reference/cli/{command}")
    _, _, parser = _build([command])
    found = flags(parser)
    assert any(found.values()), f"no flags found for pdserve {command}"
    for sub, names in found.items():
        missing = sorted(n for n in names if not re.search(rf"<code>{re.escape(n)}[ <]", text))
        assert not missing, f"pdserve {' '.join(filter(None, (command, sub)))}: flags missing from its page: {missing}"
    index = page(site, "reference/cli")
    assert f'href="{command}/"' in index, f"pdserve {command} is not in the command-line reference's index"


def test_every_metric_the_services_register_is_in_the_metrics_reference(site):
    text = page(site, "reference/metrics")
    names = set()
    for path in (REPO / "services").rglob("*.py"):
        source = path.read_text()
        if "prometheus_client" in source:
            names |= set(re.findall(r"[\"'](sglang:[a-z0-9_]+|pdserve_[a-z0-9_]+)[\"']", source))
    assert len(names) > 50, sorted(names)  # the gateway's, the workers', the tiers', the encoder's, the jobs'
    missing = sorted(n for n in names if f"<code>{n}</code>" not in text)
    assert not missing, f"metrics missing from the metrics reference: {missing}"


def test_every_helm_value_is_in_the_values_table(site):
    text = page(site, "reference/helm-values")
    values = yaml.safe_load((REPO / "helm" / "pdserve" / "values.yaml").read_text())

    def paths(tree: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in tree.items():
            out.append(prefix + key)
            if isinstance(value, dict):
                out += paths(value, f"{prefix}{key}.")
        return out

    rows = set(re.findall(r'<span id="([^"]+)"></span><code>', text))
    assert len(rows) > 100
    # A value is a row, or lies inside one (a free-form block such as `prefill.resources` is one row).
    missing = [p for p in paths(values) if not any(p == row or p.startswith(row + ".") or row.startswith(p + ".")
                                                   for row in rows)]
    assert not missing, f"Helm values missing from the values table: {missing}"


def test_every_error_status_of_the_gateway_and_jobs_is_in_the_error_codes(site):
    text = page(site, "reference/errors")
    for folder in ("services/gateway", "services/jobs"):
        statuses = {int(s) for path in (REPO / folder).rglob("*.py")
                    for s in re.findall(r"\b(?:ApiError|Busy)\((\d{3})\b", path.read_text())}
        assert statuses >= {400, 404}
        missing = sorted(s for s in statuses if f"<code>{s}</code>" not in text)
        assert not missing, f"{folder}: statuses missing from the error codes: {missing}"


def test_every_sampling_parameter_is_in_its_reference(site):
    from pdserve.services.gateway.intake.dialects import GATEWAY_DERIVED, LOGPROB_FIELDS
    from pdserve.shared.sampling_params import SamplingParams

    text = page(site, "reference/sampling-parameters")
    names = {f.name for f in dataclasses.fields(SamplingParams)} - GATEWAY_DERIVED - LOGPROB_FIELDS
    missing = sorted(n for n in names if f'<span id="{n}"></span><code>{n}</code>' not in text)
    assert not missing, f"sampling parameters missing from their reference: {missing}"


def test_the_readme_links_only_to_files_that_exist():
    readme = (REPO / "README.md").read_text()
    targets = {link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in link}
    missing = sorted(t for t in targets if t and not (REPO / t).exists())
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_docs_script_serves_the_site():
    script = REPO / "scripts" / "docs"
    assert script.stat().st_mode & 0o111, "scripts/docs is not executable"
    assert "mkdocs serve" in script.read_text()
