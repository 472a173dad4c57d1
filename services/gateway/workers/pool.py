"""WorkerPool: the gateway's client records of the runtime workers, with their health checks and DNS discovery.

`WorkerPool` owns one `Worker` per address. A background loop asks every worker for Health and Load about
once a second (five times a second while none can serve) with a short deadline; a worker whose address
refuses the call (its process is gone) is taken out at the first failed check, one that fails otherwise (no
answer in time, not ready) after two in a row.
Taking a worker out fails the requests in flight on it at once, through their `on_out` callbacks. A worker
that says it is draining (shutting down) only stops getting new requests: those in flight finish. Either is
back in rotation as soon as it answers again (a restarted worker included), unless `admission` holds it back
(a restarted worker on older weights than the deployment's, while it loads them). Worker lists may name DNS
hosts that resolve to several addresses (compose/Kubernetes services); they are resolved again every few
seconds, so workers that come and go are picked up.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.gateway.workers.multiplex import GenerateStream
from pdserve.shared.addresses import expand_hostports
from pdserve.shared.cluster_auth import worker_channel

log = logging.getLogger("pdserve.gateway")

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                # A restarted worker must be found again within seconds, not after gRPC's 2-minute backoff.
                ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", 1_000)]
ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = 1.0  # between two checks of a worker
    # Between two checks while no worker (pair) can serve, as at start-up: each gateway process finds a worker
    # that has just come up within a fraction of a second, rather than answering 503 for up to `interval_s`
    # after a sibling process on the same port has begun to serve.
    unserved_interval_s: float = 0.2
    deadline_s: float = 2.0  # for one Health answer (a dead process is refused at once; this catches hangs)
    failures_to_remove: int = 2  # consecutive failed checks that take a worker out (refused: the first)
    resolve_interval_s: float = 5.0  # between two DNS resolutions of the worker lists


@dataclass(eq=False)
class Worker:
    address: str
    role: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    healthy: bool = False
    failures: int = 0
    info: pb.InfoReply | None = None
    load: pb.LoadReply | None = None
    in_flight: int = 0  # requests this gateway has on the worker now
    moved_out: int = 0  # this gateway's generations moved live off the worker, and onto it (live_move.py)
    moved_in: int = 0
    last_error: str = ""
    draining: bool = False  # it said it is shutting down (or switching roles): no new requests, its own finish
    switching: bool = False  # this gateway is switching its role (role_switch.py)
    # Requests in flight on this worker: each callback fails its request when the worker is taken out.
    on_out: set[Callable[[str], None]] = field(default_factory=set)
    generations: GenerateStream = field(init=False)  # this process's generations on the worker, one stream

    def __post_init__(self) -> None:
        self.generations = GenerateStream(self.stub)

    @property
    def page_size(self) -> int:
        return (self.info.compat.page_size if self.info is not None else 0) or 16

    @property
    def free_pages(self) -> int:
        return self.load.free_pages if self.load is not None else 0

    def describe(self) -> dict:
        return {"address": self.address, "role": self.role, "healthy": self.healthy,
                "in_flight": self.in_flight, "last_error": self.last_error or None,
                "running": self.load.running if self.load else None,
                "waiting": self.load.waiting if self.load else None,
                "free_pages": self.load.free_pages if self.load else None,
                "total_pages": self.load.total_pages if self.load else None,
                "max_total_tokens": self.info.max_total_tokens if self.info else None,
                "max_running_requests": self.info.max_running_requests if self.info else None,
                "context_length": self.info.context_length if self.info else None,
                "tp_size": (self.info.tp_size or 1) if self.info else None,
                # Speculative decoding totals since the worker started, where it speculates.
                "speculative": ({"drafting_reqs": self.load.spec_drafting_reqs,
                                 "draft_tokens": self.load.spec_draft_tokens,
                                 "accepted_tokens": self.load.spec_accepted_tokens}
                                if self.load is not None and self.load.spec_drafting_reqs else None)}


class WorkerPool:
    def __init__(self, specs: dict[str, list[str]], settings: HealthSettings = HealthSettings()) -> None:
        unknown = set(specs) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown worker roles: {sorted(unknown)}")
        self.specs = {role: list(specs.get(role, [])) for role in ROLES}
        if self.specs["colocated"] and (self.specs["prefill"] or self.specs["decode"]):
            raise ValueError("give either --worker (colocated) or --prefill and --decode, not both")
        if not self.specs["colocated"] and not (self.specs["prefill"] and self.specs["decode"]):
            raise ValueError("give --worker HOST:PORT (colocated), or both --prefill and --decode")
        self.mode = "colocated" if self.specs["colocated"] else "pd"
        self.settings = settings
        self.workers: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        self._checking: asyncio.Task | None = None  # the check `served` runs now, shared by whoever waits for it
        # Asked each time a worker (re)joins, before it gets a request: None admits it, a reason keeps it out
        # for now (apis/admin/weights.py brings a worker back on old weights up to date meanwhile).
        self.admission: Callable[[Worker], str | None] | None = None
        self.on_rejoin: list[Callable[[str], None]] = []  # called with the address of a worker that is back
        self.on_draining: list[Callable[[Worker], None]] = []  # called with a worker first seen shutting down

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self._resolve()
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def close(self) -> None:
        for task in (self._task, self._checking):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*(w.generations.close() for w in self.workers.values()), return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.workers.values()), return_exceptions=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_resolve = loop.time() + self.settings.resolve_interval_s
        while True:
            interval = self.settings.interval_s
            if not self.has_healthy_pair():
                interval = min(interval, self.settings.unserved_interval_s)
            await asyncio.sleep(interval)
            try:
                if loop.time() >= next_resolve:
                    next_resolve = loop.time() + self.settings.resolve_interval_s
                    await self._resolve()
                await self.check_all(patient=not self.has_healthy_pair())
            except Exception:  # the loop must survive anything one round throws
                log.exception("worker health round failed")

    async def _resolve(self) -> None:
        seen: set[str] = set()
        for role in ROLES:
            for spec in self.specs[role]:
                addresses = await asyncio.to_thread(expand_hostports, spec)
                for address in addresses:
                    seen.add(address)
                    if address not in self.workers:
                        channel = worker_channel(address, options=GRPC_OPTIONS)
                        self.workers[address] = Worker(address, role, channel, pb_grpc.WorkerStub(channel))
                        log.info("%s worker %s added", role, address)
        for address in [a for a, w in self.workers.items() if a not in seen and w.in_flight == 0]:
            worker = self.workers.pop(address)
            log.info("%s worker %s no longer resolves: removed", worker.role, address)
            await worker.generations.close()
            await worker.channel.close()

    # ------------------------------------------------------------ health
    async def check_all(self, patient: bool = False) -> None:
        await asyncio.gather(*(self.check(w, patient) for w in list(self.workers.values())))

    async def check(self, worker: Worker, patient: bool = False) -> bool:
        """`patient`: wait up to the deadline for the connection rather than fail at once while gRPC backs off
        after refused attempts (up to a second), which would miss a worker that has just come up."""
        deadline = self.settings.deadline_s
        try:
            health = await worker.stub.Health(pb.Empty(), timeout=deadline, wait_for_ready=patient)
            if health.draining:
                self._drain(worker)
                return False
            worker.draining = False
            if health.role and health.role != worker.role:  # switched live (role_switch.py): Info tells the rest
                log.info("%s worker %s is a %s worker now", worker.role, worker.address, health.role)
                worker.role, worker.info = health.role, None
            if not health.ok:
                raise RuntimeError("worker reports it is not ready")
            if worker.info is None or not worker.healthy:  # (re)joining: it may have restarted differently
                worker.info = await worker.stub.Info(pb.Empty(), timeout=deadline)
                held = self.admission(worker) if self.admission is not None else None
                if held is not None:  # it answers, so this is no failure: it only waits to be let in
                    worker.last_error = held
                    return False
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            rpc = isinstance(exc, grpc.aio.AioRpcError)
            reason = exc.details() if rpc else str(exc)
            self._failed(worker, reason or "no answer", gone=rpc and exc.code() == grpc.StatusCode.UNAVAILABLE)
            return False
        if not worker.healthy:
            log.info("%s worker %s is healthy", worker.role, worker.address)
            for listener in self.on_rejoin:
                listener(worker.address)
        worker.healthy, worker.failures, worker.last_error = True, 0, ""
        try:
            # Load waits for the worker's engine thread, which a long prefill keeps busy: a late answer only
            # leaves the previous figures in place, it says nothing about health.
            worker.load = await worker.stub.Load(pb.Empty(), timeout=deadline)
        except grpc.aio.AioRpcError:
            pass
        return True

    def _failed(self, worker: Worker, reason: str, gone: bool = False) -> None:
        """`gone`: the connection was refused or lost, so waiting for a second failure would only delay."""
        worker.failures += 1
        worker.last_error = reason
        if worker.healthy and (gone or worker.failures >= self.settings.failures_to_remove):
            self.take_out(worker, reason)

    def _drain(self, worker: Worker) -> None:
        first = worker.healthy or not worker.draining
        if first:
            log.info("%s worker %s is shutting down: no new requests go to it", worker.role, worker.address)
        worker.healthy, worker.draining, worker.last_error = False, True, "shutting down"
        for listener in self.on_draining if first else ():
            listener(worker)

    def take_out(self, worker: Worker, reason: str) -> None:
        """Stop routing to `worker` until it answers a health check again; fail its requests now."""
        if worker.healthy:
            log.warning("%s worker %s taken out: %s", worker.role, worker.address, reason)
        worker.healthy = False
        worker.last_error = reason
        for fail in list(worker.on_out):
            fail(f"{worker.role} worker {worker.address} is down ({reason})")

    async def probe(self, worker: Worker) -> bool:
        """One immediate check after a request failed on `worker`: takes it out at once if it is down."""
        if await self.check(worker):
            return True
        if not worker.draining:  # a draining worker's other requests go on
            self.take_out(worker, worker.last_error)
        return False

    # ------------------------------------------------------------ views
    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.healthy and not w.switching]

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    @property
    def generate_role(self) -> str:
        """The role that serves Generate: colocated workers, or decode workers in PD mode."""
        return "colocated" if self.mode == "colocated" else "decode"

    @property
    def cache_role(self) -> str:
        """The role that holds the prefix cache: colocated workers, or prefill workers in PD mode."""
        return "colocated" if self.mode == "colocated" else "prefill"

    async def served(self) -> bool:
        """Whether a worker (pair) can serve. While none is known to, every worker is checked now rather than at
        the next round, so that a request (or a probe) is not refused for a worker that has just come up, as
        after start-up behind a sibling gateway process. One such check runs at a time; it is bounded by the
        check's own deadlines, and a request that waits for it is refused with 503 if it finds none."""
        if self.has_healthy_pair():
            return True
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self.check_all(patient=True), name="worker-check-now")
        await asyncio.shield(self._checking)  # a request that goes away does not cancel the others' check
        return self.has_healthy_pair()

    def has_healthy_pair(self) -> bool:
        if self.mode == "colocated":
            return bool(self.healthy("colocated"))
        return bool(self.healthy("prefill")) and bool(self.healthy("decode"))

    def capacity(self) -> int:
        """Requests the healthy generating workers run at once (0 while none has answered Info)."""
        return sum(w.info.max_running_requests for w in self.healthy(self.generate_role) if w.info is not None)

    def context_length(self) -> int | None:
        lengths = [w.info.context_length for w in self.workers.values() if w.info is not None and w.info.context_length]
        return min(lengths) if lengths else None
