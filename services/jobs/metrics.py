"""Prometheus metrics of the jobs service (GET /metrics), read from Redis at each scrape.

Redis holds all the state, so the figures are the same whichever jobs process is scraped and survive its
restarts; nothing is counted in process memory. A scrape reads the in-flight batches (the `deadlines` set:
batches not yet terminal) and the item stream's consumer group: a few round trips, bounded by
MAX_BATCHES_READ however many batches there are.
"""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from redis.exceptions import ResponseError

from pdserve.services.jobs.store import GROUP, Store

MAX_BATCHES_READ = 10_000  # in-flight batches whose status and counts one scrape reads


class JobsMetrics:
    def __init__(self, files_quota: int = 0) -> None:
        r = self.registry = CollectorRegistry()
        self.batches = Gauge("pdserve_jobs_batches", "batches that exist, in-flight ones by status "
                             "(status=all counts every batch kept)", ["status"], registry=r)
        self.items = Gauge("pdserve_jobs_in_flight_items", "items of the batches in flight, by outcome so far",
                           ["state"], registry=r)
        self.queue = Gauge("pdserve_jobs_queue_items", "item entries of the work queue: waiting for a batch "
                           "worker, or leased by one", ["state"], registry=r)
        self.files = Gauge("pdserve_jobs_files", "files stored", registry=r)
        self.file_bytes = Gauge("pdserve_jobs_files_bytes", "bytes counted against the files' storage quota "
                                "(files, and uploads under way)", registry=r)
        Gauge("pdserve_jobs_files_quota_bytes", "the files' storage quota (0: none)", registry=r).set(files_quota)

    async def render(self, store: Store) -> web.Response:
        await self._refresh(store)
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _refresh(self, store: Store) -> None:
        r, k = store.r, store.k
        ids = await r.zrange(k.deadlines, 0, MAX_BATCHES_READ - 1)
        pipe = r.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hmget(k.batch(batch_id), "status", "total", "completed", "failed")
        records = await pipe.execute() if ids else []
        self.batches.clear()
        self.batches.labels("all").set(await r.zcard(k.batches))
        by_status: dict[str, int] = {}
        done = failed = remaining = 0
        for status, total, completed, failures in records:
            if status is None:
                continue
            by_status[status] = by_status.get(status, 0) + 1
            completed, failures = int(completed or 0), int(failures or 0)
            done, failed = done + completed, failed + failures
            remaining += max(0, int(total or 0) - completed - failures)
        for status, count in by_status.items():
            self.batches.labels(status).set(count)
        for state, value in (("completed", done), ("failed", failed), ("remaining", remaining)):
            self.items.labels(state).set(value)
        waiting, leased = await _queue_depth(store)
        self.queue.labels("waiting").set(waiting)
        self.queue.labels("leased").set(leased)
        self.files.set(await r.zcard(k.files))
        self.file_bytes.set(await store.usage())


async def _queue_depth(store: Store) -> tuple[int, int]:
    """(entries no worker has read yet, entries read and not yet acknowledged) of the item stream."""
    try:
        groups = await store.r.xinfo_groups(store.k.items)
    except ResponseError:  # the stream does not exist yet: nothing was ever queued
        return 0, 0
    group = next((g for g in groups if g.get("name") == GROUP), None)
    if group is None:
        return 0, 0
    return int(group.get("lag") or 0), int(group.get("pending") or 0)
