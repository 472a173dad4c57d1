"""Backend: what the HTTP handlers use to reach the workers, in one object.

It owns admission (how many generations may be in flight), routing, the generations in flight (by
request id, for /abort_request) and the worker-wide operations (abort, flush, one-token health probe).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.generation import Generation, Job
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.router import NoWorker, Pair, Router
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers import WorkerPool

log = logging.getLogger("pdserve.gateway")


@dataclass(frozen=True)
class BackendSettings:
    max_queued_requests: int | None = None  # generations waiting beyond what the workers run at once
    first_output_timeout_s: float = 300.0  # queueing + prefill on the workers
    stall_timeout_s: float = 150.0  # between two outputs (the workers give up after 120 s themselves)
    max_attempts: int = 3  # pairs tried for one generation
    rpc_timeout_s: float = 10.0  # Abort, FlushCache and other small calls


class Backend:
    def __init__(self, tokenizer: ModelTokenizer, pool: WorkerPool, router: Router, metrics: GatewayMetrics,
                 settings: BackendSettings, default_context_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.settings = settings
        self.default_context_length = default_context_length
        self.in_flight = 0
        self.generations: dict[str, Generation] = {}

    # ------------------------------------------------------------ admission
    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self.pool.capacity())

    @contextmanager
    def admit(self, count: int = 1) -> Iterator[None]:
        """Hold `count` places for the generations of one request; 503 when none may start."""
        if not self.pool.has_healthy_pair():
            raise ApiError(503, "No healthy worker is available to serve the request.")
        limit = self.settings.max_queued_requests
        if limit is not None and max(0, self.in_flight + count - self.pool.capacity()) > limit:
            raise ApiError(503, f"The server is busy: more than {limit} requests would be queued "
                                f"(--max-queued-requests). Retry later.")
        self.in_flight += count
        self._gauges()
        try:
            yield
        finally:
            self.in_flight -= count
            self._gauges()

    def _gauges(self) -> None:
        self.metrics.running.set(self.in_flight)
        self.metrics.queued.set(self.queued)

    # ------------------------------------------------------------ generations
    def context_length(self) -> int:
        return self.pool.context_length() or self.default_context_length or 4096

    def route(self, input_ids: list[int], exclude: frozenset[str] = frozenset()) -> Pair:
        try:
            return self.router.choose(input_ids, exclude)
        except NoWorker as exc:
            raise ApiError(503, f"No healthy worker is available to serve the request ({exc}).") from None

    @contextmanager
    def generation(self, job: Job) -> Iterator[Generation]:
        if job.rid in self.generations:
            raise ApiError(400, f"A request with id {job.rid!r} is already running.", "rid")
        gen = Generation(self, job)
        self.generations[job.rid] = gen
        self.metrics.prompt_tokens.inc(len(job.input_ids))
        try:
            yield gen
        finally:
            self.generations.pop(job.rid, None)
            self.metrics.cached_tokens.inc(gen.cached_tokens)
            self.metrics.e2e.observe(gen.e2e_latency)

    async def probe_pair(self, pair: Pair) -> set[str]:
        """Check the workers of a pair that just failed a request; the addresses of those that are down."""
        ok = await asyncio.gather(*(self.pool.probe(w) for w in pair.workers))
        return {w.address for w, alive in zip(pair.workers, ok) if not alive}

    # ------------------------------------------------------------ worker-wide operations
    async def abort(self, rid: str) -> bool:
        """Abort request `rid` on every worker that streams output (its client sees finish_reason abort)."""
        workers = self.pool.healthy(self.pool.generate_role)
        replies = await asyncio.gather(*(w.stub.Abort(pb.AbortRequest(rid=rid), timeout=self.settings.rpc_timeout_s)
                                         for w in workers), return_exceptions=True)
        return any(isinstance(r, pb.AbortReply) and r.found for r in replies)

    async def flush_cache(self) -> list[tuple[str, bool, str]]:
        """FlushCache on every worker holding a prefix cache: (address, ok, message) each."""
        workers = self.pool.of_role(self.pool.cache_role)
        replies = await asyncio.gather(*(w.stub.FlushCache(pb.Empty(), timeout=self.settings.rpc_timeout_s)
                                         for w in workers), return_exceptions=True)
        out = []
        for w, r in zip(workers, replies):
            if isinstance(r, pb.FlushReply):
                out.append((w.address, r.ok, r.message))
                if r.ok:
                    self.router.forget(w.address)
            elif isinstance(r, grpc.aio.AioRpcError):
                out.append((w.address, False, r.details() or r.code().name))
            else:
                out.append((w.address, False, str(r)))
        return out
