"""The KV tiers' figures: TierCounts (KVTiers' own), and `tier_stats`, every tier's running totals as one flat dict
of numbers (KVTiers.stats: what the worker's /metrics, services/worker/engine/tier_metrics.py, and its stats read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.shared.kv_files import KVFiles
    from pdserve.shared.kv_host import HostPages
    from pdserve.shared.kv_tier_writer import TierWriter


@dataclass
class TierCounts:
    """The tier's figures beside KVFiles' own (read by the engine thread for metrics and stats)."""

    lookups: int = 0  # requests whose prompt went past the pool's prefix and were looked for
    hits: int = 0  # of those, requests that got at least one page from storage
    hit_tokens: int = 0
    load_seconds: float = 0.0  # summed over loads: hold -> queued
    given_up: int = 0  # loads past their deadline
    host_hits: int = 0  # requests that got at least one page back from the host tier
    host_hit_tokens: int = 0
    host_load_seconds: float = 0.0  # engine-thread time spent putting host pages back (the copies are issued)


def tier_stats(counts: TierCounts, host: HostPages | None, files: KVFiles | None, writer: TierWriter | None) -> dict:
    """Running totals, per tier (host_*: the host tier's; the rest the storage tier's), where it is."""
    stats = {"lookups": counts.lookups}
    if host is not None:
        stats.update(host_pages=host.used, host_capacity=host.num_pages, host_hits=counts.host_hits,
                     host_hit_tokens=counts.host_hit_tokens, host_load_seconds=counts.host_load_seconds,
                     host_bytes_read=host.counts.pages_out * host.page_bytes,
                     host_bytes_written=host.counts.pages_in * host.page_bytes,
                     host_dropped=host.counts.dropped)
    if files is None or writer is None:
        return stats
    pages, size = files.occupancy()
    done, dropped, bounded = files.counts, writer.dropped, files.capacity.counts
    return {**stats, "storage_pages": pages, "storage_bytes": size,
            "hits": counts.hits, "hit_tokens": counts.hit_tokens,
            "pages_read": done.pages_read, "bytes_read": done.bytes_read,
            "pages_written": done.pages_written, "bytes_written": done.bytes_written,
            "load_seconds": counts.load_seconds, "given_up": counts.given_up,
            "corrupt": done.corrupt, "refused": done.refused, "io_errors": done.errors, "writes_dropped": sum(dropped.values()),
            **{f"writes_dropped_{reason}": n for reason, n in dropped.items()},
            "io_fallbacks": done.io_fallbacks,
            "evicted_pages": bounded.evicted_pages, "evicted_bytes": bounded.evicted_bytes,
            "evicted_identities": bounded.evicted_identities, "temporaries_removed": bounded.temporaries_removed,
            "io": files.io}  # io: a name, the rest numbers
