"""An installed pdserve (the image's `pip install .`, not the editable one tests run in) holds every package:
pyproject.toml lists packages one by one, so a new folder of modules missing there is missing from the image."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(setup["packages"]), setup["package-dir"]
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join((name, *rel.parts)))
    assert found - listed == set(), "package folders missing from pyproject's [tool.setuptools] packages"
