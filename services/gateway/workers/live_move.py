"""A live move, the gateway's side: a decode worker froze a generation at a step boundary, its KV kept, and ended
its stream ABORTED "moved: <reason>" (drain or rebalance, shared/roles/move_out.py); the generation's next attempt
goes to another decode worker with the output so far (migration.py) and `kv_source_rid`, which makes that worker
take the KV from the source instead of computing it. The client's stream goes on from the gateway's per-choice
state, as after any migration. Should the attempt fail, the generation falls back to recomputing (migration.py),
counted as such with the move's reason.

`Mover` starts moves: every generation of a decode worker that says it is draining, when another healthy decode
worker can take them (else it drains as before: they finish there); and, asked by an operator (the admin route)
or the router's rebalancing, N of one worker's generations or a given one, optionally to a given worker.
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


class Mover:
    def __init__(self, pool: WorkerPool, drain_moves: bool = True) -> None:
        self.pool = pool
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

    def exclude_for(self, move: LiveMove) -> frozenset[str]:
        """Where the continuation of `move` must not go: its source, and, for a move to a named worker, every
        other decode worker."""
        target = self.targets.pop(move.rid, None)
        others = {w.address for w in self.pool.of_role("decode") if target is not None and w.address != target}
        return frozenset(others | {move.source.address})
