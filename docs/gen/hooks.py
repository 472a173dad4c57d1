"""MkDocs hook: the reference pages, written from the code at every build (`mkdocs build`, `mkdocs serve`).

None of them is a file in docs/: a flag, metric, Helm value or error status added to the code is on the site at
the next build, and one removed is gone, so the references cannot go stale. tests/docs/test_docs_site.py builds the
site and checks that every flag and metric is on it.
"""
from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).parent))

import cli_ref  # noqa: E402
import errors_ref  # noqa: E402
import helm_ref  # noqa: E402
import metrics_ref  # noqa: E402
import params_ref  # noqa: E402


def generated() -> dict[str, str]:
    """Path under docs/ -> Markdown of every generated page."""
    pages = {f"reference/cli/{name}": text for name, text in cli_ref.pages().items()}
    pages["reference/metrics.md"] = metrics_ref.page()
    pages["reference/helm-values.md"] = helm_ref.page()
    pages["reference/errors.md"] = errors_ref.page()
    pages["reference/sampling-parameters.md"] = params_ref.page()
    return pages


def on_files(files, config):
    for path, text in generated().items():
        files.append(File.generated(config, path, content=text))
    return files
