"""Prometheus metrics of the gateway, on a registry of its own (served at /metrics, without the API key).

The workers export SGLang's names (services/worker/engine/worker_metrics.py); these are the gateway's own view:
routing (requests by route and status, retries and migrations to another worker), worker health, and latencies as
clients see them.

Request counts by route and status come from a middleware; latencies and token counts from each
generation as it streams. Gauges of queue length and worker health are refreshed when scraped.

With several gateway processes on one port (--gateway-workers), prometheus_client's multiprocess mode keeps each
process's values in files under PROMETHEUS_MULTIPROC_DIR (which the parent sets before any of them imports
prometheus_client): whichever process answers /metrics reads them all, so counters and histograms are summed
over the processes, the request gauges too, and a worker's health is the view of the process that answers.
"""
from __future__ import annotations

import time
from collections import deque

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    def __init__(self, multiprocess: bool = False) -> None:
        """`multiprocess`: this is one of several gateway processes, whose metrics /metrics reports together."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_gateway_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("pdserve_gateway_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_gateway_inter_token_latency_seconds", "time between two output tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_gateway_e2e_request_latency_seconds", "request latency, first byte in to "
                             "last token out", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_parts = Histogram("pdserve_gateway_ttft_part_seconds", "where the time to first token went: "
                                    "gateway (admission, routing), network (between gateway and worker, both ways), "
                                    "worker_queue (the decode or colocated worker's "
                                    "queue), prefill_call (the Prefill call's network), prefill_queue, "
                                    "prefill_compute (colocated: the worker's own), prefill_other, kv_transfer, "
                                    "handoff (from the first token to its message leaving the worker), other (time "
                                    "in the workers that no part names)", ["part"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_gateway_prompt_tokens", "prompt tokens sent to workers", registry=r)
        self.cached_tokens = Counter("pdserve_gateway_cached_tokens", "prompt tokens served from prefix caches",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_gateway_generation_tokens", "tokens generated", registry=r)
        self.running = Gauge("pdserve_gateway_running_requests", "generations in flight", registry=r,
                             multiprocess_mode="livesum")
        self.queued = Gauge("pdserve_gateway_queued_requests", "generations beyond what the workers run at once",
                            registry=r, multiprocess_mode="livesum")
        self.workers_healthy = Gauge("pdserve_gateway_worker_healthy", "1 if the worker is in rotation",
                                     ["role", "address"], registry=r, multiprocess_mode="mostrecent")
        self.retries = Counter("pdserve_gateway_retries", "generations retried on another worker", registry=r)
        self.trace_spans_dropped = Counter("pdserve_gateway_trace_spans_dropped", "spans the trace collector did "
                                           "not take (unreachable, slow or refusing): dropped, never retried",
                                           registry=r)
        self.trace_content_dropped = Counter("pdserve_gateway_trace_content_dropped", "spans exported without "
                                             "their prompt and completions: the content awaiting export was at "
                                             "--otlp-traces-content-max-size", registry=r)
        self.migrations = Counter("pdserve_gateway_migrations", "generations moved to another worker mid-stream, "
                                  "continuing from the tokens already out: by kind (live: with their KV; recompute: "
                                  "computed again) and reason (drain, rebalance, failure)", ["kind", "reason"],
                                  registry=r)
        self.migration_seconds = Histogram("pdserve_gateway_migration_seconds", "a live move's time, from its "
                                           "stream's end on the source to its first token from the destination",
                                           ["kind"], buckets=(.01, .025, .05, .1, .25, .5, 1, 2, 5, 10, 30),
                                           registry=r)
        self.migration_bytes = Histogram("pdserve_gateway_migration_bytes", "KV bytes a live move wrote into the "
                                         "destination's pool", buckets=tuple(2.0 ** k for k in range(16, 34, 2)),
                                         registry=r)
        self.rebalances = Counter("pdserve_gateway_rebalance_decisions", "generations the router's rebalancing "
                                  "(--rebalance-decode) asked a decode worker to move live", registry=r)
        # The SLO planner's (--planner slo): what it did, what it would have done, and what it would want.
        self.role_switches = Counter("pdserve_planner_role_switches", "workers the planner switched to another "
                                     "role, by the role left, the role taken and why", ["from", "to", "reason"],
                                     registry=r)
        self.dry_run_switches = Counter("pdserve_planner_dry_run_switches", "switches the planner would have made "
                                        "(--planner-dry-run)", ["from", "to", "reason"], registry=r)
        self.desired_workers = Gauge("pdserve_planner_desired_workers", "workers of the role that would bring it "
                                     "within its SLO: what an autoscaler (HPA, KEDA) would add pods for",
                                     ["role"], registry=r, multiprocess_mode="mostrecent")
        self.pressure = Gauge("pdserve_planner_pressure", "the role's figures as a share of its SLO (1: at it)",
                              ["role"], registry=r, multiprocess_mode="mostrecent")
        self.recent = RecentLatencies()

        # What /metrics shows: this registry, or every process's files read at each scrape.
        self.shown = r
        if multiprocess:
            self.shown = CollectorRegistry()
            MultiProcessCollector(self.shown)

    def render(self) -> web.Response:
        return web.Response(body=generate_latest(self.shown), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def samples(self, metric) -> list:
        """The samples of one of these metrics as /metrics shows them (with several processes, their sums)."""
        name = metric.describe()[0].name
        return next((family.samples for family in self.shown.collect() if family.name == name), [])


class RecentLatencies:
    """TTFTs and inter-token gaps of the last minutes, with when each was seen: the window the planner reads."""

    def __init__(self, keep: int = 100_000) -> None:
        self.ttft: deque[tuple[float, float]] = deque(maxlen=keep)  # (when, seconds)
        self.itl: deque[tuple[float, float, int]] = deque(maxlen=keep)  # (when, seconds per token, tokens)

    def ttft_quantile(self, since: float, q: float = 0.9) -> float | None:
        values = sorted(v for t, v in self.ttft if t >= since)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    def itl_mean(self, since: float) -> float | None:
        gaps = [(gap * n, n) for t, gap, n in self.itl if t >= since]
        tokens = sum(n for _, n in gaps)
        return sum(g for g, _ in gaps) / tokens if tokens else None


class TokenTimer:
    """TTFT and inter-token latency of one generation, fed one worker message at a time."""

    def __init__(self, metrics: GatewayMetrics, start: float) -> None:
        self.metrics = metrics
        self.start = start
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        self.metrics.generation_tokens.inc(n)
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
            self.metrics.recent.ttft.append((now, now - self.start))
        else:
            gap = (now - self.last) / n  # several tokens in one message share the gap
            for _ in range(n):
                self.metrics.itl.observe(gap)
            self.metrics.recent.itl.append((now, gap, n))
        self.last = now
