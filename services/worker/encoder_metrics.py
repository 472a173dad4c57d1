"""EncoderMetrics: an embedding worker's Prometheus metrics (GET /metrics), on a registry of its own.

SGLang's names where the generative workers (services/worker/engine/worker_metrics.py) use them for the same
thing, so one dashboard reads both; what only an encoder has is `pdserve_worker_encoder_*`. Counts and latencies
come from the Encoder's thread as each request completes or fails; the queue gauges are read when scraped.
"""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.services.worker.engine.worker_metrics import NAME
from pdserve.shared.encoder import Encoder

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EncoderMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        m = model_name
        self.running = Gauge("sglang:num_running_reqs", "sequences in the forward now", NAME, registry=r).labels(m)
        self.queued = Gauge("sglang:num_queue_reqs", "sequences waiting for a forward", NAME, registry=r).labels(m)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "input tokens encoded", NAME, registry=r).labels(m)
        self.requests = Counter("sglang:num_requests", "requests answered", NAME, registry=r).labels(m)
        self.failed = Counter("sglang:num_aborted_requests", "requests whose forward failed", NAME,
                              registry=r).labels(m)
        self.trace_spans_dropped = Counter("pdserve_worker_trace_spans_dropped", "spans the trace collector did "
                                           "not take: dropped, never retried", NAME, registry=r).labels(m)
        self.sequences = Counter("pdserve_worker_encoder_sequences", "input sequences encoded", NAME,
                                 registry=r).labels(m)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "arrival to the request's last vector",
                             NAME, buckets=LATENCY_BUCKETS, registry=r).labels(m)
        self.forward = Histogram("pdserve_worker_encoder_forward_seconds", "one batched forward, pooling included",
                                 NAME, buckets=LATENCY_BUCKETS, registry=r).labels(m)

    # ------------------------------------------------------------ the Encoder's observer (its thread)
    def finished(self, sequences: int, tokens: int, seconds: float) -> None:
        self.requests.inc()
        self.sequences.inc(sequences)
        self.prompt_tokens.inc(tokens)
        self.e2e.observe(seconds)

    def forwarded(self, seconds: float) -> None:
        self.forward.observe(seconds)

    def failed_requests(self, count: int) -> None:
        self.failed.inc(count)

    # ------------------------------------------------------------ HTTP
    def scrape(self, encoder: Encoder) -> web.Response:
        self.running.set(encoder.running)
        self.queued.set(encoder.waiting)
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
