"""The examples of the API pages (docs/apis/) run, as written, against a live gateway and colocated worker.

Each page's ```python blocks run in order in one namespace, as a reader pastes them one after another, with the
gateway's address in place of http://127.0.0.1:30000; the Files and Batches page's against a gateway that also has
the jobs service (on a redis-server of its own). A block that needs what these do not serve (an embedding model)
is marked `<!-- not run: why -->` on the line above it; every other block must run to its end, so an example
whose route, field or answer changed fails here.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))

from harness import start_gateway  # noqa: E402
from jobs_harness import RedisServer, start_jobs  # noqa: E402

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


@pytest.fixture(scope="module")
def with_jobs(colocated, default_model_dir, tmp_path_factory):
    """A gateway in front of the colocated worker and a jobs service (one batch worker) on its own Redis."""
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    jobs = gateway = None
    try:
        jobs, jobs_url = start_jobs(redis_server.url(), colocated.open.url, "--batch-workers", "1", api_key=None)
        gateway = start_gateway(default_model_dir, "--worker", colocated.worker, "--jobs-url", jobs_url)
        gateway.proc.wait_healthy(60)
        yield gateway.url
    finally:
        for proc in (gateway and gateway.proc, jobs):
            if proc is not None:
                proc.stop()
        redis_server.stop()


def test_the_api_pages_have_examples():
    assert {"openai.md", "native.md", "files-batches.md"} <= set(PAGES)


@pytest.mark.parametrize("name", PAGES)
def test_the_examples_of_an_api_page_run(request, colocated, name):
    blocks, _ = examples(DOCS / name)
    assert blocks, f"docs/apis/{name} has no example that runs"
    url = request.getfixturevalue("with_jobs") if name == "files-batches.md" else colocated.open.url
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        code = block.replace("http://127.0.0.1:30000", url)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"docs/apis/{name} example {number}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - the failing example and what it printed, for the report
            pytest.fail(f"docs/apis/{name}, example {number} failed: {exc!r}\n--- code\n{block}\n"
                        f"--- printed\n{out.getvalue()}")
        assert out.getvalue().strip(), f"docs/apis/{name}, example {number} printed nothing"
