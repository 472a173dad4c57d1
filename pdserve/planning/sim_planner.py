"""What the simulated gateway's planner sees and what it did: the observation the gateway's loop
(services/gateway/workers/planning.py) builds from its token timer and the workers' Load answers, built here from
the simulation's first tokens, token gaps and schedulers; and each switch, with when it began and when the worker
served in its new role.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from pdserve.services.gateway.planner import Observation, WorkerLoad


@dataclass
class Switch:
    at: float  # the planner decided
    address: str
    source: str
    target: str
    reason: str
    done: float | None = None  # the worker serves in its new role

    def as_dict(self) -> dict:
        return {"at_s": self.at, "address": self.address, "from": self.source, "to": self.target,
                "reason": self.reason, "done_s": self.done}


def worker_load(worker) -> WorkerLoad:
    s = worker.scheduler
    read = sum(r.num_cached_pages for r in s.running)
    free = s.allocator.num_free + max(0, s.cache.num_pages - read)
    total = s.allocator.num_pages
    return WorkerLoad(worker.address, len(s.running) + len(worker.awaiting_kv),
                      len(s.waiting) + len(worker.reserving), 1 - free / total if total else 0.0)


def observe(sim, now: float) -> Observation:
    """The window's TTFT p90 and mean ITL, and the load of every worker in rotation (one that is switching is in
    neither role's)."""
    since = now - sim.planner.settings.window_s
    ttfts = sorted(v for t, v in sim.first_seen[bisect.bisect_left(sim.first_seen, (since,)):] if t <= now)
    ttft = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None
    recent = [(g, n) for t, g, n in sim.gaps[bisect.bisect_left(sim.gaps, (since,)):] if t <= now]
    tokens = sum(n for _, n in recent)
    itl = sum(g for g, _ in recent) / tokens if tokens else None
    return Observation(now, ttft, itl, tuple(worker_load(w) for w in sim.pool.serving["prefill"]),
                       tuple(worker_load(w) for w in sim.pool.serving["decode"]))
