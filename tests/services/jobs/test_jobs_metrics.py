"""The jobs service's /metrics, read from Redis: batches by status, items by outcome, the work queue's depth;
open to scrapers that hold no API key."""
from __future__ import annotations

import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from jobs_harness import chat_line, create_batch, wait_batch


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    r = requests.get(url + "/metrics", timeout=10)  # no Authorization header
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_a_batch_from_queue_to_done(jobs_system):
    url = jobs_system.jobs_url.removesuffix("/v1")
    before = scrape(url)
    c = jobs_system.client()
    total = 300
    batch = create_batch(c, [chat_line(f"m-{i}", f"question {i}") for i in range(total)])
    seen_in_flight = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = scrape(url)
        state = c.batches.retrieve(batch.id).status
        if state == "in_progress" and value(now, "pdserve_jobs_batches", status="in_progress") >= 1:
            items = sum(value(now, "pdserve_jobs_in_flight_items", state=s) for s in ("completed", "failed", "remaining"))
            assert items >= total  # this batch's items, whatever their outcome so far (others may be in flight)
            seen_in_flight = True
            break
        if state in ("completed", "failed"):
            break
        time.sleep(0.05)
    done, _ = wait_batch(c, batch.id)
    assert done.status == "completed"
    after = scrape(url)
    assert value(after, "pdserve_jobs_batches", status="all") == value(before, "pdserve_jobs_batches", status="all") + 1
    assert value(after, "pdserve_jobs_files") >= value(before, "pdserve_jobs_files") + 2  # input and output files
    assert ("pdserve_jobs_queue_items", (("state", "waiting"),)) in after
    assert seen_in_flight, "the batch was never seen in flight in the metrics"
