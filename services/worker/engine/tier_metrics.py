"""TierMetrics: the KV tiers' series on a worker's /metrics (--enable-hierarchical-cache), beside WorkerMetrics.

The storage tier's under SGLang's names where SGLang has one (`sglang:prefetched_tokens`, `sglang:backuped_tokens`),
`pdserve_worker_kv_storage_*` for the rest; the host-memory tier's `pdserve_worker_kv_host_*`. The tiers keep
running totals (KVTiers.stats); `refresh`, on the engine thread at each scrape, adds to each counter what its
total gained since the previous scrape.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.shared.kv_tier_writer import DROP_REASONS

NAME = ["model_name"]
# stats() key -> (series, help); each a counter of the tier's running total.
COUNTED = {
    "lookups": ("pdserve_worker_kv_storage_lookups", "requests whose prompt went past the pool's prefix and were "
                "looked for in the storage tier"),
    "hits": ("pdserve_worker_kv_storage_hits", "of those, requests that got at least one page from storage"),
    "load_seconds": ("pdserve_worker_kv_storage_load_seconds", "time requests waited for their stored pages, summed"),
    "given_up": ("pdserve_worker_kv_storage_loads_given_up", "reads past --hicache-storage-prefetch-timeout: what "
                 "had not arrived was computed"),
    "corrupt": ("pdserve_worker_kv_storage_corrupt_pages", "page files that failed their check (deleted; the page "
                "was computed again)"),
    "refused": ("pdserve_worker_kv_storage_refused_pages", "files under a page's name not written by this "
                "deployment: a MAC not its own (forged, another deployment's, altered), a link, a FIFO, another "
                "user's file (deleted; the page was computed again)"),
    "evicted_pages": ("pdserve_worker_kv_storage_evicted_pages", "page files deleted to keep the directory under "
                      "--hicache-storage-max-size or above --hicache-storage-min-free-space, least recently used "
                      "first"),
    "evicted_bytes": ("pdserve_worker_kv_storage_evicted_bytes", "bytes of those page files"),
    "evicted_identities": ("pdserve_worker_kv_storage_evicted_identities", "identities nobody used for an hour "
                           "deleted whole to make room, before any page of the worker's own"),
    "temporaries_removed": ("pdserve_worker_kv_storage_temporaries_removed", "temporary files of writes never "
                            "finished (a killed worker's) deleted at start"),
    "io_errors": ("pdserve_worker_kv_storage_io_errors", "reads, writes or flushes that failed with an OS error"),
}


# stats() key -> (series, help), for the host-memory tier.
HOST_COUNTED = {
    "host_hits": ("pdserve_worker_kv_host_hits", "requests that got at least one page back from the host tier"),
    "host_hit_tokens": ("pdserve_worker_kv_host_hit_tokens", "prompt tokens copied back from the host tier"),
    "host_load_seconds": ("pdserve_worker_kv_host_load_seconds", "engine-thread time spent issuing the copies back "
                          "from the host tier, summed"),
    "host_dropped": ("pdserve_worker_kv_host_dropped_pages", "pages the pool evicted that found no host slot free "
                     "(every one being written to storage)"),
}


class TierMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, page_size: int, host: bool = False,
                 storage: bool = True) -> None:
        self.model_name = model_name
        self.page_size = page_size
        self._seen: dict[str, float] = {}
        self.host = self._host_series(registry) if host else None
        self.storage = storage
        if storage:
            self._storage_series(registry)

    def _host_series(self, r: CollectorRegistry) -> dict:
        m = self.model_name
        series = {key: Counter(name, doc, NAME, registry=r).labels(m) for key, (name, doc) in HOST_COUNTED.items()}
        series["bytes"] = Counter("pdserve_worker_kv_host_bytes", "KV bytes copied into the host tier (written) and "
                                  "back into the pool (read)", NAME + ["direction"], registry=r)
        for direction in ("read", "written"):
            series["bytes"].labels(m, direction)
        series["pages"] = Gauge("pdserve_worker_kv_host_pages", "pages the host tier holds", NAME,
                                registry=r).labels(m)
        series["capacity"] = Gauge("pdserve_worker_kv_host_capacity_pages", "pages the host tier can hold", NAME,
                                   registry=r).labels(m)
        return series

    def _storage_series(self, r: CollectorRegistry) -> None:
        m = self.model_name
        self.prefetched = Counter("sglang:prefetched_tokens", "prompt tokens read from the storage tier into the "
                                  "pool", NAME, registry=r).labels(m)
        self.backuped = Counter("sglang:backuped_tokens", "tokens written to the storage tier", NAME,
                                registry=r).labels(m)
        self.counted = {key: Counter(name, doc, NAME, registry=r).labels(m) for key, (name, doc) in COUNTED.items()}
        self.dropped = Counter("pdserve_worker_kv_storage_dropped_writes", "pages meant for the storage tier and "
                               "not written, by reason: behind (evicted under write_back while a quarter of the pool "
                               "waited to be written), evicted (waiting their turn behind the part of a long prompt "
                               "being written, evicted by the pool first)", NAME + ["reason"], registry=r)
        for reason in DROP_REASONS:
            self.dropped.labels(m, reason)
        self.bytes = Counter("pdserve_worker_kv_storage_bytes", "KV bytes read from and written to the storage tier",
                             NAME + ["direction"], registry=r)
        for direction in ("read", "written"):
            self.bytes.labels(m, direction)
        self.pages = Gauge("pdserve_worker_kv_storage_pages", "pages stored under this worker's weights (the "
                           "directory walked every minute, writes and evictions counted between)", NAME, registry=r).labels(m)
        self.stored_bytes = Gauge("pdserve_worker_kv_storage_stored_bytes", "bytes of those page files", NAME,
                                  registry=r).labels(m)

    def refresh(self, stats: dict) -> None:
        """Engine thread: the tiers' figures (KVTiers.stats) into the series."""
        if self.host is not None:
            for key in HOST_COUNTED:
                self.host[key].inc(self._gain(stats, key))
            self.host["bytes"].labels(self.model_name, "read").inc(self._gain(stats, "host_bytes_read"))
            self.host["bytes"].labels(self.model_name, "written").inc(self._gain(stats, "host_bytes_written"))
            self.host["pages"].set(stats["host_pages"])
            self.host["capacity"].set(stats["host_capacity"])
        if not self.storage:
            return
        self.prefetched.inc(self._gain(stats, "hit_tokens"))
        self.backuped.inc(self._gain(stats, "pages_written") * self.page_size)
        for key, counter in self.counted.items():
            counter.inc(self._gain(stats, key))
        for reason in DROP_REASONS:
            self.dropped.labels(self.model_name, reason).inc(self._gain(stats, f"writes_dropped_{reason}"))
        self.bytes.labels(self.model_name, "read").inc(self._gain(stats, "bytes_read"))
        self.bytes.labels(self.model_name, "written").inc(self._gain(stats, "bytes_written"))
        self.pages.set(stats["storage_pages"])
        self.stored_bytes.set(stats["storage_bytes"])

    def _gain(self, stats: dict, key: str) -> float:
        gain = stats[key] - self._seen.get(key, 0)
        self._seen[key] = stats[key]
        return max(gain, 0)
