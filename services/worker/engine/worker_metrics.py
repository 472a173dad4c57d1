"""WorkerMetrics: a runtime worker's Prometheus metrics, on a registry of its own (served at /metrics).

Names, types and the `model_name` label are SGLang's, so dashboards, alerts and llm-d's endpoint picker made
for SGLang read pdserve as they are; what SGLang has no name for is `pdserve_worker_*`. Values come from:
- the engine's request lifecycle (the RequestObserver hooks, on the engine thread): latencies and tokens.
  A PD pair splits each request: the prefill worker reports its queue time, prompt and cached tokens; the
  decode worker its time to first token, inter-token and end-to-end latency and generated tokens. A
  colocated worker reports all of them. Summed over workers, no token is counted twice;
- each KV transfer of a prefill worker (`transferred`, `transfer_failed`), by decode peer;
- the engine's queues and KV pool, read on the engine thread when scraped (`refresh`);
- the KV tiers, where there are some (tier_metrics.py).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.services.worker.engine.tier_metrics import TierMetrics
from pdserve.shared.engine import Engine
from pdserve.shared.observer import RequestObserver
from pdserve.shared.req import Req, ReqStatus

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
                120.0, 300.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HIT_RATE_WINDOW = 256  # the cache hit rate covers this many latest prompts, as a gauge of now, not of all time
# A scrape waits this long for the engine thread to refresh the gauges; a longer step leaves them as they
# were at the previous scrape, so scrapes (every 50 ms from an endpoint picker) never wait on the model.
REFRESH_TIMEOUT_S = 0.5
NAME = ["model_name"]


class WorkerMetrics(RequestObserver):
    def __init__(self, model_name: str, page_size: int, num_pages: int, max_lora: int | None = None,
                 counts_at_prefill: bool = False) -> None:
        """`max_lora`: adapter slots of one batch when LoRA is enabled (None: it is not, and no LoRA metric).
        `counts_at_prefill`: a request's work here ends once its prompt is prefilled (the role says: a prefill
        worker's), so it counts as finished then."""
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.counts_at_prefill = counts_at_prefill
        self.page_size = page_size
        self._prompts: deque[tuple[int, int]] = deque(maxlen=HIT_RATE_WINDOW)  # (prompt, cached) tokens
        self._computed_seen = {"prefill": 0, "decode": 0}
        m = model_name
        # Gauges of now, set by refresh().
        self.running = Gauge("sglang:num_running_reqs", "requests running (decoding, or prefilling a chunk)",
                             NAME, registry=r).labels(m)
        self.queued = Gauge("sglang:num_queue_reqs", "requests waiting to start (decode: also for KV pages)",
                            NAME, registry=r).labels(m)
        self.transfer_queue = Gauge("sglang:num_decode_transfer_queue_reqs",
                                    "decode role: requests whose KV pages the prefill worker is filling",
                                    NAME, registry=r).labels(m)
        self.used_tokens = Gauge("sglang:num_used_tokens", "KV-cache tokens held by requests", NAME,
                                 registry=r).labels(m)
        self.token_usage = Gauge("sglang:token_usage", "fraction of the KV cache in use, 0 to 1; prefix-cache "
                                 "pages no request holds count as free (they are evicted on demand)",
                                 NAME, registry=r).labels(m)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", f"fraction of prompt tokens served from the prefix "
                                    f"cache over the latest {HIT_RATE_WINDOW} prompts", NAME, registry=r).labels(m)
        self.free_pages = Gauge("pdserve_worker_free_pages", "KV pages free or evictable", NAME, registry=r).labels(m)
        self.cached_pages = Gauge("pdserve_worker_cached_pages", "KV pages held by the prefix cache", NAME,
                                  registry=r).labels(m)
        self.trace_records = Gauge("pdserve_worker_engine_trace_records", "requests whose timings the engine keeps "
                                   "for a span not ended yet (traced generations in progress)", NAME,
                                   registry=r).labels(m)
        # Configuration, set once.
        Gauge("sglang:max_total_num_tokens", "tokens the KV cache holds", NAME, registry=r).labels(m).set(
            num_pages * page_size)
        Gauge("pdserve_worker_total_pages", "KV pages in the pool", NAME, registry=r).labels(m).set(num_pages)
        self._cache_config_info(r, num_pages)
        self.lora_info = None if max_lora is None else Gauge(
            "sglang:lora_requests_info", "adapters of running and waiting requests (value: when last updated, "
            "Unix seconds)", NAME + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.max_lora = max_lora
        # Request lifecycle.
        self.prompt_tokens = Counter("sglang:prompt_tokens", "prompt tokens prefilled here", NAME,
                                     registry=r).labels(m)
        self.cached_tokens = Counter("sglang:cached_tokens", "prompt tokens served from the prefix cache", NAME,
                                     registry=r).labels(m)
        self.generation_tokens = Counter("sglang:generation_tokens", "tokens generated and sent from here", NAME,
                                         registry=r).labels(m)
        self.requests = Counter("sglang:num_requests", "requests finished here (prefill role: prefilled)", NAME,
                                registry=r).labels(m)
        self.aborted = Counter("sglang:num_aborted_requests", "requests aborted (by clients or errors)", NAME,
                               registry=r).labels(m)
        self.computed_tokens = Counter("pdserve_worker_tokens", "tokens computed by forward passes, by kind "
                                       "(prefill includes the recompute of retracted requests)",
                                       NAME + ["kind"], registry=r)
        for kind in self._computed_seen:  # exposed at 0 from the start, as the other counters are
            self.computed_tokens.labels(m, kind)
        self.queue_time = Histogram("sglang:queue_time_seconds", "arrival to the first prompt chunk's step",
                                    NAME, buckets=QUEUE_BUCKETS, registry=r).labels(m)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "arrival to the first output token sent",
                              NAME, buckets=TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "time between two output tokens sent", NAME,
                             buckets=ITL_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "arrival to the last output sent", NAME,
                             buckets=E2E_BUCKETS, registry=r).labels(m)
        # Speculative decoding, where the worker speculates (SGLang's gauges, over the latest verify steps).
        self.spec_accept_length = Gauge("sglang:spec_accept_length", "tokens a drafting request gains per verify "
                                         "step (accepted drafts + 1)", NAME, registry=r).labels(m)
        self.spec_accept_rate = Gauge("sglang:spec_accept_rate", "draft tokens accepted over drafted", NAME,
                                      registry=r).labels(m)
        self.spec_verify = Counter("sglang:spec_verify_calls", "verify steps (decode steps that carried drafts)",
                                   NAME, registry=r).labels(m)
        self.spec_tokens = Counter("pdserve_worker_spec_draft_tokens", "draft tokens verified, and accepted",
                                   NAME + ["outcome"], registry=r)
        self._spec_seen = (0, 0, 0)  # the speculator's totals at the previous refresh
        # KV transfer (prefill role), by decode peer.
        self.transfer_bytes = Counter("pdserve_worker_kv_transfer_bytes", "KV bytes written to decode workers",
                                      NAME + ["peer"], registry=r)
        self.transfer_seconds = Histogram("pdserve_worker_kv_transfer_seconds", "time of one request's KV write",
                                          NAME + ["peer"], buckets=TRANSFER_BUCKETS, registry=r)
        self.transfer_failures = Counter("pdserve_worker_kv_transfer_failures", "KV writes that failed",
                                         NAME + ["peer"], registry=r)
        # What a KV reservation's fence could not do (shared/transfer/fence.py), by reason: prefill role
        # "abort_late" (the engine did not drop an aborted request at once; its writes are refused meanwhile),
        # "write_still_running"; decode role "lease_expired" (pages given back on the lease, unacknowledged).
        self.fence_failures = Counter("pdserve_worker_kv_fence_failures", "KV reservation fences not settled "
                                      "as asked", NAME + ["reason"], registry=r)
        self.tiers: TierMetrics | None = None  # the KV tiers' series, where the worker has them (`watch_tiers`)

    def watch_tiers(self, host: bool, storage: bool) -> None:
        """The engine has KV tiers (--enable-hierarchical-cache): their series too, from now on."""
        self.tiers = TierMetrics(self.registry, self.model_name, self.page_size, host=host, storage=storage)

    def _cache_config_info(self, registry: CollectorRegistry, num_pages: int) -> None:
        # SGLang's label names, and vLLM's beside them: an endpoint picker pointed at this metric with
        # --cache-info-metric reads block_size / num_gpu_blocks unless told SGLang's names.
        info = Gauge("sglang:cache_config_info", "KV cache layout (value 1)",
                     NAME + ["page_size", "num_pages", "block_size", "num_gpu_blocks"], registry=registry)
        info.labels(self.model_name, self.page_size, num_pages, self.page_size, num_pages).set(1)

    # ------------------------------------------------------------ request lifecycle (engine thread)
    def scheduled(self, req: Req) -> None:
        # A fresh prompt, in any role (a decode worker computes a conversation's short next turn itself); a
        # retracted request recomputed had its queue time, and one whose KV came from a prefill worker none here.
        if not req.output_ids:
            self.queue_time.observe(req.first_scheduled - req.arrival)

    def prefilled(self, req: Req) -> None:
        prompt = len(req.input_ids)
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(req.cached_tokens)
        self._prompts.append((prompt, req.cached_tokens))
        if self.counts_at_prefill:  # its work for the request ends here
            self.requests.inc()

    def output(self, req: Req, num_tokens: int, finish_reason: str | None) -> None:
        now = time.monotonic()
        self.generation_tokens.inc(num_tokens)
        if req.index != 0:  # latencies once per request; the other choices of n > 1 arrived at their fork
            return
        if num_tokens:
            self._token_latency(req, num_tokens, now)
        if finish_reason is not None:
            self._finished(finish_reason, now - req.arrival)

    def _token_latency(self, req: Req, num_tokens: int, now: float) -> None:
        if req.last_output is None:
            self.ttft.observe(now - req.arrival)
        else:
            gap = (now - req.last_output) / num_tokens  # tokens sent together share the wait
            for _ in range(num_tokens):
                self.itl.observe(gap)
        req.last_output = now

    def _finished(self, finish_reason: str, e2e_s: float) -> None:
        self.requests.inc()
        if finish_reason == "abort":
            self.aborted.inc()
        else:
            self.e2e.observe(e2e_s)

    # ------------------------------------------------------------ KV transfer (prefill role, engine thread)
    def transferred(self, peer: str, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(self.model_name, peer).inc(num_bytes)
        self.transfer_seconds.labels(self.model_name, peer).observe(seconds)

    def transfer_failed(self, peer: str) -> None:
        self.transfer_failures.labels(self.model_name, peer).inc()

    def fence_failed(self, reason: str) -> None:
        self.fence_failures.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------ gauges (engine thread)
    def refresh(self, engine: Engine) -> None:
        load = engine.load()
        total = load["total_pages"]
        used = total - load["free_pages"]
        self.running.set(load["running"])
        self.queued.set(load["waiting"])
        self.used_tokens.set(used * self.page_size)
        self.token_usage.set(used / total if total else 0.0)
        self.free_pages.set(load["free_pages"])
        self.cached_pages.set(load["cached_pages"])
        prompt = sum(p for p, _ in self._prompts)
        self.cache_hit_rate.set(sum(c for _, c in self._prompts) / prompt if prompt else 0.0)
        # StepStats keeps running totals: the counters take what they gained since the last scrape.
        for kind, count in (("prefill", engine.stats.prefill_tokens), ("decode", engine.stats.decode_tokens)):
            self.computed_tokens.labels(self.model_name, kind).inc(count - self._computed_seen[kind])
            self._computed_seen[kind] = count
        self._refresh_requests(engine.scheduler.live_reqs())
        if engine.speculator is not None:
            self._refresh_speculation(engine)
        if self.tiers is not None and engine.tiers is not None:
            self.tiers.refresh(engine.tiers.stats())

    def _refresh_speculation(self, engine: Engine) -> None:
        spec = engine.speculator
        length, rate = spec.figures()
        self.spec_accept_length.set(length)
        self.spec_accept_rate.set(rate)
        totals = (spec.verify_steps, spec.drafted_tokens, spec.accepted_tokens)
        steps, drafted, accepted = (now - seen for now, seen in zip(totals, self._spec_seen))
        self._spec_seen = totals
        self.spec_verify.inc(steps)
        self.spec_tokens.labels(self.model_name, "drafted").inc(drafted)
        self.spec_tokens.labels(self.model_name, "accepted").inc(accepted)

    def _refresh_requests(self, reqs: list[Req]) -> None:
        self.transfer_queue.set(sum(1 for r in reqs if r.status == ReqStatus.WAITING_FOR_KV))
        if self.lora_info is None:
            return
        waiting = {r.lora.name for r in reqs if r.lora is not None and r.status <= ReqStatus.WAITING_FOR_PAGES}
        running = {r.lora.name for r in reqs if r.lora is not None and r.status > ReqStatus.WAITING_FOR_PAGES}
        self.lora_info.clear()  # one series, the current one: label values change as adapters come and go
        self.lora_info.labels(self.model_name, self.max_lora, ",".join(sorted(running)),
                              ",".join(sorted(waiting))).set(time.time())

    async def scrape(self, engine: Engine) -> web.Response:
        """The exposition text, with the gauges refreshed on the engine thread (see REFRESH_TIMEOUT_S)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.call(lambda: self.refresh(engine))),
                                   REFRESH_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
