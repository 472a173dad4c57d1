"""Backend: what the HTTP handlers use to reach the workers, in one object; no handler touches the worker pool.

It owns admission (how many sequences may be in flight), routing, the generations in flight (by request id:
an id runs once at a time) and the worker-wide operations (abort, which the workers answer by the client's id;
flush; one-token health probe).

Every request that runs on the workers passes its `door` and is counted there until it ends, whichever API it
came through (or a background task): a weight update (apis/admin/weights.py) closes the door, waits until none runs,
swaps the weights and opens it again, so no request runs across a swap.

Admission counts sequences: a generation holds `n` places from the moment it is registered until it ends, a
prefill-only call (score, embeddings) one place while it runs.
Beyond what the healthy workers run at once plus `max_queued_requests`, a request is refused at once with
429 and Retry-After rather than left to queue for minutes. When several processes serve the gateway's port
(--gateway-workers N), each admits its 1/N share of that room (at least one sequence), so that the gateway as a
whole holds the limit without the processes sharing a counter.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Iterator, TypeVar

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services import tracing
from pdserve.services.gateway.errors import ApiError, Busy
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.timelines import FlightRecorder
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers.generation import Generation, GenerationSettings
from pdserve.services.gateway.workers.job import Job
from pdserve.services.gateway.workers.kv_events import CacheFeeds
from pdserve.services.gateway.workers.live_move import Mover
from pdserve.services.gateway.workers.pool import Worker, WorkerPool
from pdserve.services.gateway.workers.router import NoWorker, Pair, Router

log = logging.getLogger("pdserve.gateway")


T = TypeVar("T")
DEFAULT_MAX_QUEUED = 256  # sequences waiting beyond what the workers run at once


@dataclass(frozen=True)
class BackendSettings(GenerationSettings):
    """Admission and worker-wide calls; the generations' retries and timeouts come from GenerationSettings."""

    max_queued_requests: int | None = DEFAULT_MAX_QUEUED  # sequences waiting beyond the workers' (None: no limit)
    rpc_timeout_s: float = 10.0  # Abort, FlushCache and other small calls
    processes: int = 1  # gateway processes serving the port: each admits its share of the room
    rebalance_decode: bool = False  # move running generations live from a full decode worker to an empty one


class Door:
    """Requests for the workers pass while it is open, and are counted from then until they end."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.in_flight = 0

    async def passage(self) -> None:
        """Return once the door is open (at once while it is)."""
        while not self._open.is_set():  # woken by one update, a next one may have closed it again
            await self._open.wait()

    @contextmanager
    def inside(self) -> Iterator[None]:
        """Counted while it runs: enter right after `passage`, with no await between."""
        self.in_flight += 1
        self._drained.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._drained.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def drained(self, timeout: float) -> bool:
        """Whether every request counted has ended within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Backend:
    def __init__(self, tokenizer: ModelTokenizer, pool: WorkerPool, router: Router, metrics: GatewayMetrics,
                 settings: BackendSettings, default_context_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.router = router
        # The workers' cache events fill the router's tables (only a cache-aware router reads them).
        self.feeds = CacheFeeds(pool, router) if getattr(router, "policy", "") == "cache_aware" else None
        self.metrics = metrics
        self.settings = settings
        self.default_context_length = default_context_length
        self.in_flight = 0
        self.generations: dict[str, Generation] = {}
        self.mover = Mover(pool, metrics.rebalances)  # live moves: off a draining decode worker, or asked
        pool.on_draining.append(self.mover.draining)
        self.door = Door()
        self.recorder = FlightRecorder()  # the last requests' timelines (services/gateway/timelines.py)

    # ------------------------------------------------------------ admission
    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self._share(self.pool.capacity()))

    def _share(self, places: int) -> int:
        """This process's part of `places` (all of them when it serves the port alone)."""
        return places if self.settings.processes == 1 else max(1, places // self.settings.processes)

    async def admit(self, count: int = 1) -> None:
        """Let a request of `count` prompts in once the door is open, or refuse it: 503 when no worker pair is
        healthy (checked now if none was at the last round), 429 when even one sequence per prompt would not
        fit. Its generations then hold their places (`generation`, entered with no await after this)."""
        with tracing.section("admission", prompts=count):
            await self.door.passage()
            if not await self.pool.served():
                raise Busy(503, "No healthy worker is available to serve the request.", self.settings.retry_after_s)
            self._check_room(count)

    @asynccontextmanager
    async def encoding(self) -> AsyncIterator[None]:
        """A prefill-only call (score, embeddings, rerank, classify) passes the door and holds one place while
        it runs, under the same limit as generations: 429 when it would queue beyond it. (A worker runs one such
        call's groups one after another, between its decode steps.)"""
        await self.door.passage()
        self._check_room(1)
        self.in_flight += 1
        self._gauges()
        try:
            with self.door.inside():
                yield
        finally:
            self.in_flight -= 1
            self._gauges()

    def _check_room(self, sequences: int) -> None:
        limit = self.settings.max_queued_requests
        if limit is not None and self.in_flight + sequences > self._share(self.pool.capacity() + limit):
            raise Busy(429, f"The server is busy: {sequences} more sequence(s) would queue beyond the limit of "
                            f"{limit} (--max-queued-requests). Retry after {self.settings.retry_after_s} s.",
                       self.settings.retry_after_s)

    def _gauges(self) -> None:
        self.metrics.running.set(self.in_flight)
        self.metrics.queued.set(self.queued)

    # ------------------------------------------------------------ generations
    def context_length(self) -> int:
        return self.pool.context_length() or self.default_context_length or 4096

    def route(self, input_ids: list[int], exclude: frozenset[str] = frozenset(),
              cache_salt: str | None = None) -> Pair:
        try:
            return self.router.choose(input_ids, exclude, cache_salt)
        except NoWorker as exc:
            raise Busy(503, f"No healthy worker is available to serve the request ({exc}).",
                       self.settings.retry_after_s) from None

    @contextmanager
    def generation(self, job: Job) -> Iterator[Generation]:
        """Register a generation, counted inside the door; it holds `n` places (429 when they would queue beyond
        the limit). Enter it right after `admit` (or the door's `passage`), with no await between."""
        if job.rid in self.generations:
            raise ApiError(400, f"A request with id {job.rid!r} is already running.", "rid")
        places = job.params.n
        self._check_room(places)
        gen = Generation(job, self, self.tokenizer, self.metrics, self.settings)
        self.generations[job.rid] = gen
        self.in_flight += places
        self._gauges()
        self.metrics.prompt_tokens.inc(len(job.input_ids))
        try:
            with self.door.inside():
                yield gen
        finally:
            self.generations.pop(job.rid, None)
            self.in_flight -= places
            self._gauges()
            self.metrics.cached_tokens.inc(gen.cached_tokens)
            self.metrics.e2e.observe(gen.e2e_latency)
            self.recorder.record(gen.record.finish(gen))

    def end_all(self, reason: str) -> int:
        """End every generation in flight with an error (the gateway is stopping); how many there were."""
        gens = list(self.generations.values())
        for gen in gens:
            gen._fail(reason)
        return len(gens)

    async def probe_pair(self, pair: Pair) -> set[str]:
        """Check the workers of a pair that just failed a request; the addresses of those that are down."""
        ok = await asyncio.gather(*(self.pool.probe(w) for w in pair.workers))
        return {w.address for w, alive in zip(pair.workers, ok) if not alive}

    # ------------------------------------------------------------ worker-wide operations
    async def abort(self, public_id: str | None, everything: bool = False) -> list[str]:
        """Abort the requests sent under the client's id `public_id` (or all of them) on every worker that
        streams output, whichever gateway sent them; their clients see finish_reason abort. The ids aborted."""
        request = pb.AbortRequest(public_id=public_id or "", all=everything)
        replies = await self.broadcast(self.pool.healthy(self.pool.generate_role),
                                       lambda w: w.stub.Abort(request, timeout=self.settings.rpc_timeout_s))
        return list(dict.fromkeys(i for r in replies if isinstance(r, pb.AbortReply) for i in r.aborted))

    async def flush_cache(self, tiers: tuple[str, ...] = ()) -> list[tuple[str, bool, str]]:
        """FlushCache of `tiers` (none: every tier) on every worker holding a prefix cache (in PD the decode workers
        too, which compute a conversation's next turn after the prefix they hold): (address, ok, message) each."""
        roles = [self.pool.cache_role] + (["decode"] if self.pool.mode != "colocated" else [])
        workers = [w for role in roles for w in self.pool.of_role(role)]
        request = pb.FlushRequest(tiers=list(tiers))
        replies = await self.broadcast(workers, lambda w: w.stub.FlushCache(request,
                                                                              timeout=self.settings.rpc_timeout_s))
        out = []
        for w, r in zip(workers, replies):
            if isinstance(r, pb.FlushReply):
                out.append((w.address, r.ok, r.message))
                if r.ok and (not tiers or "device" in tiers):  # its pool holds no prefix any more
                    self.router.forget(w.address)
            elif isinstance(r, grpc.aio.AioRpcError):
                out.append((w.address, False, r.details() or r.code().name))
            else:
                out.append((w.address, False, str(r)))
        return out

    async def broadcast(self, workers: list[Worker], call: Callable[[Worker], Awaitable[T]]) -> list[T | BaseException]:
        """`call` on every worker at once: its reply, or the exception it raised, for each."""
        return await asyncio.gather(*(call(w) for w in workers), return_exceptions=True)

    # ------------------------------------------------------------ the workers, as the handlers see them
    async def start(self) -> None:
        await self.pool.start()
        if self.settings.rebalance_decode:
            self.mover.start()

    async def close(self) -> None:
        await self.mover.close()
        if self.feeds is not None:
            await self.feeds.close()
        await self.pool.close()

    @property
    def mode(self) -> str:
        """"colocated" or "pd"."""
        return self.pool.mode

    @property
    def cache_role(self) -> str:
        return self.pool.cache_role

    def workers(self) -> list[Worker]:
        """Every worker known, healthy or not, by role and address."""
        return sorted(self.pool.workers.values(), key=lambda w: (w.role, w.address))

    def generating_workers(self) -> list[Worker]:
        """The workers that serve Generate (colocated, or decode in PD mode), healthy or not."""
        return self.pool.of_role(self.pool.generate_role)

    def serving_workers(self) -> list[Worker]:
        """The workers that hold the model's weights: the targets of LoRA, weight and expert calls."""
        roles = ("colocated",) if self.pool.mode == "colocated" else ("prefill", "decode")
        return [w for role in roles for w in self.pool.of_role(role)]

    def healthy_cache_workers(self) -> list[Worker]:
        """Healthy workers that hold a prefix cache, where prefill-only calls (Encode) go."""
        return self.pool.healthy(self.pool.cache_role)

    async def served(self) -> bool:
        """Whether a worker pair can serve, checking the workers now if none could at the last round."""
        return await self.pool.served()

    async def probe(self, worker: Worker) -> bool:
        """Check `worker` after a call failed on it; takes it out at once if it is down."""
        return await self.pool.probe(worker)

    def take_out(self, worker: Worker, reason: str) -> None:
        """Route nothing to `worker` until it passes a health check (and the admission check) again."""
        self.pool.take_out(worker, reason)

    def admit_workers_with(self, check: Callable[[Worker], str | None]) -> None:
        """Ask `check` before a worker (re)joins: None lets it in, a reason holds it back for now."""
        self.pool.admission = check
