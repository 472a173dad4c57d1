"""The router learns from the workers what their caches hold, in which tier: two colocated workers of the default
model, each with a storage tier of its own, behind a gateway that has never routed the prompts.

What a user sees: a prompt that one worker computed (sent there by another gateway) is served by it again, its
prefix cached (`meta_info.cached_tokens` > 0), though this gateway's routing alone would send it to the other
worker; and once every pool has been flushed (`/flush_cache?tiers=device`), the prompt still goes to the worker
whose storage tier holds its pages, and is read back from there. Each prompt is picked so that the router,
without the workers' events, would choose the worker that does not hold it.
"""
from __future__ import annotations

import random
import time

import pytest
import requests

from pdserve.services.gateway.workers.router import rendezvous
from pdserve.shared.kv_events import prefix_hashes
from procs import Proc, free_port, start_worker

ADMIN_KEY = "sk-test-admin-key"
PAGE = 16
TOKENS = 6 * PAGE + 5


def gateway(model_dir, *addresses: str) -> tuple[Proc, str]:
    port = free_port()
    workers = [arg for a in addresses for arg in ("--worker", a)]
    proc = Proc("gateway", ["gateway", "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                            *workers, "--health-check-interval", "0.5"],
                health_url=f"http://127.0.0.1:{port}/health").start({"PDSERVE_ADMIN_API_KEY": ADMIN_KEY,
                                                                      "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def system(default_model_dir, tmp_path):
    procs, workers = [], []
    try:
        for name in ("a", "b"):
            proc, addr = start_worker("colocated", None, "--page-size", str(PAGE), "--enable-hierarchical-cache",
                                      "--hicache-storage-backend", "file", "--hicache-storage-dir",
                                      str(tmp_path / f"kv-{name}"), "--hicache-storage-prefetch-policy",
                                      "wait_complete")
            procs.append(proc)
            workers.append(addr)
        both, url = gateway(default_model_dir, *workers)
        procs.append(both)
        singles = []
        for addr in workers:
            proc, single_url = gateway(default_model_dir, addr)
            procs.append(proc)
            singles.append(single_url)
        for proc in procs:
            proc.wait_healthy(180)
        yield url, workers, singles, [p.health_url.replace("/health", "/metrics") for p in procs[:2]]
    finally:
        for proc in procs:
            proc.stop()


def generate(url: str, ids: list[int]) -> int:
    """Prompt tokens served from a cache."""
    r = requests.post(f"{url}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def prompt_routed_away_from(holder: str, workers: list[str], seed: int) -> list[int]:
    """Token ids whose first page the router's tie-break (two idle workers, no history) sends to the other."""
    rng = random.Random(seed)
    while True:
        ids = [rng.randrange(1000, 40000) for _ in range(TOKENS)]
        first = prefix_hashes(ids, PAGE, 1)[0]
        if max(workers, key=lambda w: rendezvous(first, w)) != holder:
            return ids


def backed_up(metrics_url: str) -> float:
    for line in requests.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("sglang:backuped_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_router_sends_a_prompt_where_a_worker_says_its_prefix_is_device_or_storage(system):
    url, workers, singles, metrics = system
    for i, holder in enumerate(workers):
        ids = prompt_routed_away_from(holder, workers, seed=i)
        assert generate(singles[i], ids) == 0  # computed on `holder`, behind a gateway that only knows it
        deadline = time.monotonic() + 30
        while backed_up(metrics[i]) < (TOKENS // PAGE) * PAGE:
            assert time.monotonic() < deadline, "the prompt's pages were not written to storage"
            time.sleep(0.2)
        time.sleep(1.0)  # the events reach the gateway within an engine iteration; allow for a busy machine
        assert generate(url, ids) >= (TOKENS // PAGE - 1) * PAGE, f"not routed to {holder}, which holds it"

        # No pool holds it any more, and this gateway forgets what it routed: the storage tier is all that knows.
        r = requests.post(f"{url}/flush_cache?tiers=device", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                          timeout=30)
        assert r.status_code == 200, r.text
        time.sleep(1.0)
        assert generate(url, ids) >= (TOKENS // PAGE - 1) * PAGE, f"not routed to {holder}'s storage tier"
