"""The gateway's decode rebalancing (live_move.Mover.balance_once): where one decode worker's pool is much fuller
than another's, half the difference in running generations is asked to move live to the emptier one, and each
decision is counted; close pools, or too few generations, move nothing. Over stand-in worker records whose
Migrate answers what it was asked (the move itself is test_live_move.py's)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.workers.live_move import MoveRefused, Mover
from pdserve.services.gateway.workers.pool import Worker


class Stub:
    def __init__(self) -> None:
        self.asked: list[pb.MigrateRequest] = []

    async def Migrate(self, request, timeout=None):  # noqa: N802 (the stub's name)
        self.asked.append(request)
        return pb.MigrateReply(frozen=[f"r{i}" for i in range(request.count)])


class Pool:
    def __init__(self, workers: list[Worker]) -> None:
        self.workers = {w.address: w for w in workers}

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]


def decode(address: str, free: int, running: int, role: str = "decode") -> Worker:
    w = Worker(address, role, channel=None, stub=Stub(), healthy=True)
    w.load = pb.LoadReply(running=running, free_pages=free, total_pages=100)
    return w


def mover(*workers: Worker) -> tuple[Mover, Counter]:
    decisions = Counter("decisions", "", registry=CollectorRegistry())
    return Mover(Pool(list(workers)), decisions), decisions


async def test_a_much_fuller_pool_moves_half_the_difference_to_the_emptiest():
    hot, cold, mid = decode("a:1", free=10, running=9), decode("b:1", free=95, running=1), decode("c:1", 60, 4)
    m, decisions = mover(hot, cold, mid)
    assert await m.balance_once() == 4
    (asked,) = hot.stub.asked
    assert asked.count == 4 and asked.reason == "rebalance" and not cold.stub.asked
    assert decisions._value.get() == 4
    assert m.targets == {f"r{i}": "b:1" for i in range(4)}  # each continuation goes to the emptiest


@pytest.mark.parametrize("loads", [[(40, 6), (60, 1)], [(10, 2), (95, 1)]])
async def test_close_pools_or_few_generations_move_nothing(loads):
    workers = [decode(f"w{i}:1", free, running) for i, (free, running) in enumerate(loads)]
    m, decisions = mover(*workers)
    assert await m.balance_once() == 0
    assert not any(w.stub.asked for w in workers) and decisions._value.get() == 0


async def test_a_move_asked_of_a_worker_that_cannot_is_refused_with_why():
    m, _ = mover(decode("a:1", 10, 5), decode("p:1", 10, 5, role="prefill"))
    with pytest.raises(MoveRefused, match="no healthy decode worker"):
        await m.rebalance(m.pool.workers["p:1"], count=1)
    with pytest.raises(MoveRefused, match="No other healthy decode worker"):
        await m.rebalance(m.pool.workers["a:1"], count=1)
    with pytest.raises(MoveRefused, match="not another healthy decode worker"):
        await m.rebalance(m.pool.workers["a:1"], count=1, to="a:1")
