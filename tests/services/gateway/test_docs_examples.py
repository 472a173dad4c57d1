"""The examples of the API pages (docs/apis/) run, as written, against a live gateway and colocated worker.

Each page's ```python blocks run in order in one namespace, as a reader pastes them one after another, with the
gateway's address in place of http://127.0.0.1:30000. A block that needs what this gateway does not serve (an
embedding model, the jobs service) is marked `<!-- not run: why -->` on the line above it; every other block must
run to its end, so an example whose route, field or answer changed fails here.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs" / "apis"
FENCE = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)
SKIP = "<!-- not run:"


def examples(page: Path) -> tuple[list[str], list[str]]:
    """(blocks to run, blocks marked not run) of one page, in order."""
    run, skipped = [], []
    for match in FENCE.finditer("\n" + page.read_text()):
        (skipped if match["before"].strip().startswith(SKIP) else run).append(match["code"])
    return run, skipped


PAGES = sorted(p.name for p in DOCS.glob("*.md") if any(examples(p)))


def test_the_api_pages_have_examples():
    assert {"openai.md", "native.md"} <= set(PAGES)


@pytest.mark.parametrize("name", PAGES)
def test_the_examples_of_an_api_page_run(colocated, name):
    blocks, _ = examples(DOCS / name)
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        code = block.replace("http://127.0.0.1:30000", colocated.open.url)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"docs/apis/{name} example {number}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - the failing example and what it printed, for the report
            pytest.fail(f"docs/apis/{name}, example {number} failed: {exc!r}\n--- code\n{block}\n"
                        f"--- printed\n{out.getvalue()}")
        assert out.getvalue().strip(), f"docs/apis/{name}, example {number} printed nothing"
