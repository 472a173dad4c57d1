"""The examples of the API pages (docs/apis/) run, as written, against a live gateway.

The gateway serves what the pages call: the default model on a colocated worker, all-MiniLM-L6-v2 on an embedding
worker, and the jobs service. Each page's ```python blocks run in order in one namespace, as a reader pastes them
one after another, with the gateway's address in place of http://127.0.0.1:30000. A block that needs what this
gateway does not serve is marked `<!-- not run: why -->` on the line above it; every other block must run to its
end, so an example whose route, field or answer changed fails here.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
import time
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))

from harness import System, start_gateway, start_worker  # noqa: E402
from jobs_harness import RedisServer, start_jobs  # noqa: E402

MINILM = "all-MiniLM-L6-v2"
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
def gateway(colocated, default_model_dir, minilm_dir, tmp_path_factory):
    """A gateway serving what the examples call: the colocated worker's model, all-MiniLM-L6-v2 on an embedding
    worker of its own, and the jobs service (one batch worker) on a redis-server of its own."""
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    system = System()
    jobs = None
    try:
        jobs, jobs_url = start_jobs(redis_server.url(), colocated.open.url, "--batch-workers", "1", api_key=None)
        emb, emb_addr = start_worker("colocated", MINILM, "--is-embedding")
        system.workers[emb_addr] = emb
        gw = start_gateway(default_model_dir, "--worker", colocated.worker, "--jobs-url", jobs_url,
                           "--embedding-model", MINILM, "--embedding-worker", emb_addr)
        system.gateways.append(gw)
        for proc in (emb, gw.proc):
            proc.wait_healthy(240)
        # The gateway is healthy once its own model's worker is; the embedding worker joins at its next round.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and requests.post(
                gw.url + "/encode", json={"model": MINILM, "text": "ready?"}, timeout=60).status_code != 200:
            time.sleep(0.5)
        yield gw.url
    finally:
        system.stop()
        if jobs is not None:
            jobs.stop()
        redis_server.stop()


def test_the_api_pages_have_examples():
    assert {"openai.md", "native.md", "responses.md", "messages.md", "files-batches.md"} <= set(PAGES)


@pytest.mark.parametrize("name", PAGES)
def test_the_examples_of_an_api_page_run(gateway, name):
    blocks, _ = examples(DOCS / name)
    assert blocks, f"docs/apis/{name} has no example that runs"
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        code = block.replace("http://127.0.0.1:30000", gateway)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"docs/apis/{name} example {number}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - the failing example and what it printed, for the report
            pytest.fail(f"docs/apis/{name}, example {number} failed: {exc!r}\n--- code\n{block}\n"
                        f"--- printed\n{out.getvalue()}")
        assert out.getvalue().strip(), f"docs/apis/{name}, example {number} printed nothing"
