"""A live move, the gateway's side: a decode worker froze a generation at a step boundary, its KV kept, and ended
its stream ABORTED "moved: <reason>" (drain or rebalance, shared/roles/move_out.py); the generation's next attempt
goes to another decode worker with the output so far (migration.py) and `kv_source_rid`, which makes that worker
take the KV from the source instead of computing it. The client's stream goes on from the gateway's per-choice
state, as after any migration. Should the attempt fail, the generation falls back to recomputing (migration.py),
counted as such with the move's reason.

`Mover` starts moves: every generation of a decode worker that says it is draining, when another healthy decode
worker can take them (else it drains as before: they finish there); and, asked by an operator (the admin route
POST /workers/migrate, `pdserve debug migrate`) or by its own rebalancing (--rebalance-decode, off by default),
N of one worker's generations or a given one, optionally to a given worker. Rebalancing looks every
REBALANCE_INTERVAL_S: where one decode worker's pool is fuller than another's by REBALANCE_GAP of its pages and
runs at least two more generations, half the difference moves to the emptier one; each decision is counted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.workers.pool import Worker, WorkerPool
from pdserve.shared.outputs import MOVED, is_moved

log = logging.getLogger("pdserve.gateway")
MIGRATE_TIMEOUT_S = 5.0
REBALANCE_INTERVAL_S = 2.0
REBALANCE_GAP = 0.5  # of the pool's pages, used here against there


@dataclass
class LiveMove(Exception):
    """The attempt's decode worker froze the generation under `rid` to move it (`reason`)."""

    source: Worker
    rid: str
    reason: str
    since: float = field(default_factory=time.perf_counter)  # when its stream ended there

    def __str__(self) -> str:
        return f"moved live off {self.source.address} ({self.reason})"


def live_move(exc: grpc.aio.AioRpcError, source: Worker, rid: str) -> LiveMove | None:
    details = exc.details() or ""
    if exc.code() != grpc.StatusCode.ABORTED or not is_moved(details):
        return None
    return LiveMove(source, rid, details[len(MOVED):])


def aim(request: pb.GenerateRequest, move: LiveMove) -> None:
    """The attempt that continues `move` takes its KV from the worker it froze on."""
    request.prefill_addr, request.kv_source_rid = move.source.address, move.rid


class MoveRefused(Exception):
    """A move asked for that cannot start: `status` (HTTP) and why."""

    def __init__(self, status: int, message: str, param: str) -> None:
        super().__init__(message)
        self.status, self.param = status, param


class Mover:
    def __init__(self, pool: WorkerPool, decisions=None, drain_moves: bool = True) -> None:
        """`decisions`: counts the rebalancing's moves (a Counter), where it runs."""
        self.pool = pool
        self.decisions = decisions
        self.drain_moves = drain_moves
        self.targets: dict[str, str] = {}  # worker rid -> the decode worker a rebalance asked it to move to
        self._tasks: set[asyncio.Task] = set()

    def peers_of(self, worker: Worker) -> list[Worker]:
        return [w for w in self.pool.healthy("decode") if w.address != worker.address]

    def draining(self, worker: Worker) -> None:
        """`worker` said it is shutting down: move its generations live, if any other decode worker can."""
        if not self.drain_moves or worker.role != "decode" or not self.peers_of(worker):
            return
        task = asyncio.ensure_future(self.migrate(worker, pb.MigrateRequest(all=True, reason="drain")))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def migrate(self, worker: Worker, request: pb.MigrateRequest) -> pb.MigrateReply | None:
        try:
            reply = await worker.stub.Migrate(request, timeout=MIGRATE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("decode worker %s did not freeze its generations for a live move (%s): they %s there",
                        worker.address, exc.details() or exc.code().name,
                        "drain" if request.reason == "drain" else "stay")
            return None
        if reply.frozen or reply.refused:
            log.info("decode worker %s moves %d generation(s) live (%s)%s", worker.address, len(reply.frozen),
                     request.reason, f"; not moved live: {'; '.join(reply.refused)}" if reply.refused else "")
        return reply

    async def rebalance(self, worker: Worker, rids: list[str] = (), count: int = 0,
                        to: str | None = None) -> pb.MigrateReply:
        """Move `rids` (the workers' ids of the generations) or `count` of `worker`'s generations live, to the
        decode worker `to` or wherever the router sends them; MoveRefused where none can move."""
        if worker.role != "decode" or not worker.healthy:
            raise MoveRefused(400, f"{worker.address} is no healthy decode worker: only a decode worker's "
                                   "generations move live.", "url")
        peers = {w.address for w in self.peers_of(worker)}
        if to is not None and to not in peers:
            raise MoveRefused(400, f"{to} is not another healthy decode worker; GET /workers lists them.", "to")
        if not peers:
            raise MoveRefused(409, f"No other healthy decode worker can take {worker.address}'s generations.", "url")
        for rid in rids if to is not None else ():
            self.targets[rid] = to
        reply = await self.migrate(worker, pb.MigrateRequest(rids=list(rids), count=count, reason="rebalance"))
        if reply is None:
            raise MoveRefused(503, f"{worker.address} did not answer the move.", "url")
        for rid in reply.frozen if to is not None else ():
            self.targets[rid] = to
        return reply

    def start(self) -> None:
        self._tasks.add(asyncio.get_running_loop().create_task(self._balance(), name="rebalance-decode"))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _balance(self) -> None:
        while True:
            await asyncio.sleep(REBALANCE_INTERVAL_S)
            try:
                await self.balance_once()
            except Exception:  # one bad round must not end rebalancing
                log.exception("decode rebalancing round failed")

    async def balance_once(self) -> int:
        """One look at the decode workers' loads: move half the difference from the fullest pool to the emptiest
        where they differ by REBALANCE_GAP; the generations asked to move."""
        loads = [(w, used_share(w), w.load.running) for w in self.pool.healthy("decode") if w.load is not None]
        if len(loads) < 2:
            return 0
        hot, cold = max(loads, key=lambda x: x[1]), min(loads, key=lambda x: x[1])
        count = (hot[2] - cold[2]) // 2
        if hot[1] - cold[1] < REBALANCE_GAP or count < 1:
            return 0
        reply = await self.rebalance(hot[0], count=count, to=cold[0].address)
        if self.decisions is not None:
            self.decisions.inc(len(reply.frozen))
        return len(reply.frozen)

    def exclude_for(self, move: LiveMove) -> frozenset[str]:
        """Where the continuation of `move` must not go: its source, and, for a move to a named worker, every
        other decode worker."""
        target = self.targets.pop(move.rid, None)
        others = {w.address for w in self.pool.of_role("decode") if target is not None and w.address != target}
        return frozenset(others | {move.source.address})


def used_share(worker: Worker) -> float:
    """Of the worker's pool, the share held by requests (neither free nor cached)."""
    load = worker.load
    return 1 - load.free_pages / load.total_pages if load.total_pages else 0.0
