"""The storage tier of KV pages end to end: a colocated worker of the default model with
`--enable-hierarchical-cache --hicache-storage-backend file` behind a gateway, stopped and started again on the
same directory.

What a user sees: the second worker, its pool empty, serves the same prompt with its prefix read from the files
(`meta_info.cached_tokens` > 0, all of it from storage in `cached_tokens_details`, SGLang's
`sglang:prefetched_tokens` on /metrics) and the same greedy text;
`/flush_cache?tiers=device` keeps the files (the prefix is read from them again), `/flush_cache` makes them
unreachable, so a third worker finds nothing; an unknown tier name is a 400 naming `tiers`. A prompt longer than a
quarter of the pool, pushed out by others as long, comes back from storage.
"""
from __future__ import annotations

import contextlib
import re
import time

import pytest
import requests

from pdserve.benchclient import make_prompts
from procs import Proc, free_port, start_worker

ADMIN_KEY = "sk-test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PAGE = 16
PROMPT = ("A storage tier keeps the KV pages of prompts it has seen in files beside the worker, so that a worker "
          "started again on the same directory reads a long shared prefix instead of computing it. Summarise the "
          "idea in one sentence:")
NEW_TOKENS = 12


@pytest.fixture
def system(default_model_dir, tmp_path):
    """A gateway and the colocated worker behind it (restart with `restart`)."""
    with serving(default_model_dir, tmp_path, "--enable-deterministic-inference") as running:
        yield running


@contextlib.contextmanager
def serving(model_dir, tmp_path, *extra: str):
    worker, addr = start_worker("colocated", None, "--page-size", str(PAGE), "--enable-hierarchical-cache",
                                "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path / "kv"),
                                "--hicache-storage-prefetch-policy", "wait_complete", *extra)
    port = free_port()
    gateway = Proc("gateway", ["gateway", "--model-path", str(model_dir), "--host", "127.0.0.1",
                               "--port", str(port), "--worker", addr, "--health-check-interval", "0.5"],
                   health_url=f"http://127.0.0.1:{port}/health").start({"PDSERVE_ADMIN_API_KEY": ADMIN_KEY,
                                                                         "OMP_NUM_THREADS": "1"})
    procs = {"worker": worker, "gateway": gateway}
    try:
        worker.wait_healthy(180)
        gateway.wait_healthy(120)
        yield procs, f"http://127.0.0.1:{port}"
    finally:
        for proc in procs.values():
            proc.stop()


def restart(procs: dict[str, Proc], url: str) -> None:
    """Stop the worker and start it again on its own command line (same ports, same directory)."""
    old = procs["worker"]
    old.stop()
    until(lambda: requests.get(f"{url}/health", timeout=5).status_code != 200, "the gateway to see the worker gone")
    procs["worker"] = Proc(old.name, old.args, health_url=old.health_url).start()
    procs["worker"].wait_healthy(180)
    until(lambda: requests.get(f"{url}/health", timeout=5).status_code == 200, "the gateway to see it back")


def until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.1)


def generate(url: str, prompt: str = PROMPT) -> tuple[str, int, int]:
    """(greedy text, prompt tokens, prompt tokens served from a cache); each of those from the storage tier."""
    r = requests.post(f"{url}/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": meta["cached_tokens"]}
    return r.json()["text"], meta["prompt_tokens"], meta["cached_tokens"]


def metric(procs: dict[str, Proc], name: str, labels: str = "") -> float:
    """One series of the worker's /metrics (its HTTP port serves /health and /metrics)."""
    text = requests.get(procs["worker"].health_url.replace("/health", "/metrics"), timeout=10).text
    found = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(labels)}[^}}]*}} (\S+)$", text, re.M)
    assert found, f"{name} {labels} not on /metrics"
    return float(found.group(1))


def flush(url: str, query: str = "") -> requests.Response:
    return requests.post(f"{url}/flush_cache{query}", headers=ADMIN, timeout=30)


def test_a_restarted_worker_reads_the_prefix_from_storage_until_it_is_flushed(system):
    procs, url = system
    text, prompt_tokens, cached = generate(url)
    assert cached == 0 and prompt_tokens > 2 * PAGE
    stored = (prompt_tokens // PAGE) * PAGE  # whole pages of the prompt are written (write_through)
    until(lambda: metric(procs, "sglang:backuped_tokens_total") >= stored, "the prompt's pages to be written")
    assert metric(procs, "pdserve_worker_kv_storage_bytes_total", 'direction="written"') > 0

    restart(procs, url)
    assert generate(url) == (text, prompt_tokens, stored - (PAGE if stored == prompt_tokens else 0))
    assert metric(procs, "sglang:prefetched_tokens_total") > 0
    assert metric(procs, "pdserve_worker_kv_storage_hits_total") == 1
    assert metric(procs, "pdserve_worker_kv_storage_bytes_total", 'direction="read"') > 0

    # The device tier alone: the pool forgets the prefix, the files still hold it.
    assert flush(url, "?tiers=device").status_code == 200
    again = generate(url)
    assert again[0] == text and again[2] > 0
    assert metric(procs, "pdserve_worker_kv_storage_hits_total") == 2
    refused = flush(url, "?tiers=disk")
    assert refused.status_code == 400 and refused.json()["param"] == "tiers" and "'disk'" in refused.json()["message"]

    # Every tier: what was stored is unreachable, for this worker and the next one on the directory.
    assert flush(url).status_code == 200
    restart(procs, url)
    assert generate(url) == (text, prompt_tokens, 0)
    assert metric(procs, "sglang:prefetched_tokens_total") == 0


def test_in_pd_the_client_is_told_the_prefill_read_the_prefix_from_storage(default_model_dir, tmp_path):
    """Prefill with the storage tier, decode without: once /flush_cache emptied every pool (the decode worker's
    too, which would otherwise compute the prompt's end after the prefix it holds), the prefill worker reads the
    prefix back, and the answer (through the decode worker) says it came from storage."""
    tier = ("--page-size", str(PAGE), "--enable-deterministic-inference", "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path / "kv"),
            "--hicache-storage-prefetch-policy", "wait_complete", "--transfer-backend", "tcp")
    prefill, paddr = start_worker("prefill", None, *tier)
    decode, daddr = start_worker("decode", None, "--page-size", str(PAGE), "--enable-deterministic-inference",
                                 "--transfer-backend", "tcp", "--prefill", paddr)
    port = free_port()
    gateway = Proc("gateway", ["gateway", "--model-path", str(default_model_dir), "--host", "127.0.0.1",
                               "--port", str(port), "--prefill", paddr, "--decode", daddr],
                   health_url=f"http://127.0.0.1:{port}/health")
    procs = {"prefill": prefill, "decode": decode, "gateway": gateway}
    url = f"http://127.0.0.1:{port}"
    try:
        prefill.wait_healthy(180)
        decode.wait_healthy(180)
        gateway.start({"PDSERVE_ADMIN_API_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1"}).wait_healthy(120)
        text, prompt_tokens, cached = generate(url)
        assert cached == 0
        procs["worker"] = prefill  # `metric` reads the prefill worker's series
        stored = (prompt_tokens // PAGE) * PAGE
        until(lambda: metric(procs, "sglang:backuped_tokens_total") >= stored, "the prompt's pages to be written")
        flushed = flush(url, "?tiers=device")
        assert flushed.status_code == 200, flushed.text
        again = generate(url)  # asserts cached_tokens_details: every cached token from storage
        assert again[0] == text and again[2] > 0
    finally:
        for proc in procs.values():
            proc.stop()


def test_a_prompt_past_a_quarter_of_the_pool_comes_back_from_storage(default_model_dir, tmp_path):
    """A 4,096-token pool, a ~1,900-token prompt (the writer takes at most a quarter of the pool at once: it is
    written in parts), then three others as long, which push all of it out of the pool (bench_kv_tiers.py's
    `long` case pushes it with five, and times it); asked again, it is read back."""
    long, *others = make_prompts(4, 1900, 52)
    with serving(default_model_dir, tmp_path, "--max-total-tokens", "4096") as (procs, url):
        text, prompt_tokens, cached = generate(url, long)
        assert cached == 0 and 1800 <= prompt_tokens < 2048
        until(lambda: metric(procs, "sglang:backuped_tokens_total") >= prompt_tokens // PAGE * PAGE,
              "the long prompt's pages to be written", timeout=60)
        for other in others:
            assert generate(url, other)[2] == 0  # each asserts that nothing came from the pool or the host
        again, _, cached = generate(url, long)  # every cached token from storage: the pool holds none of it
        assert again == text and cached >= 1000
        assert metric(procs, "pdserve_worker_kv_storage_dropped_writes_total", 'reason="behind"') == 0
