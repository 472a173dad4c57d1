"""switch_role's refusals, decided from the gateway's view of its workers before any worker is asked, and a role
switched by another gateway (process or replica) learnt from the worker's health check (the worker's own refusals
and the switch itself: test_role_switch.py, on real workers)."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.workers.pool import Worker, WorkerPool
from pdserve.services.gateway.workers.role_switch import SwitchRefused, refusal, switch_role


def pd_pool(prefill: int = 1, decode: int = 2) -> WorkerPool:
    specs = {"prefill": [f"10.0.0.1:{i}" for i in range(prefill)], "decode": [f"10.0.0.2:{i}" for i in range(decode)]}
    pool = WorkerPool(specs)
    for role, addresses in specs.items():
        for address in addresses:
            pool.workers[address] = Worker(address, role, None, None, healthy=True, info=pb.InfoReply())
    return pool


def reason(pool: WorkerPool, address: str, role: str) -> str | None:
    refused = refusal(pool, pool.workers[address], role)
    return refused.reason if refused is not None else None


def test_the_last_worker_of_a_role_stays():
    pool = pd_pool(prefill=1, decode=2)
    assert reason(pool, "10.0.0.1:0", "decode") == "last_of_role"
    assert reason(pool, "10.0.0.2:0", "prefill") is None
    pool.workers["10.0.0.2:1"].healthy = False  # the other decode worker is down: this one is the last
    assert reason(pool, "10.0.0.2:0", "prefill") == "last_of_role"


def test_a_worker_switching_or_not_serving_is_refused():
    pool = pd_pool()
    worker = pool.workers["10.0.0.2:0"]
    worker.switching = True
    assert reason(pool, worker.address, "prefill") == "switch_in_progress"
    assert pool.healthy("decode") == [pool.workers["10.0.0.2:1"]]  # no new request reaches it meanwhile
    worker.switching, worker.healthy = False, False
    assert reason(pool, worker.address, "prefill") == "worker_not_serving"


def test_same_role_and_mixed_deployments_are_refused():
    pool = pd_pool()
    assert reason(pool, "10.0.0.2:0", "decode") == "same_role"
    assert reason(pool, "10.0.0.2:0", "colocated") == "mixed_deployment"
    colocated = WorkerPool({"colocated": ["10.0.0.3:0", "10.0.0.3:1"]})
    for address in colocated.specs["colocated"]:
        colocated.workers[address] = Worker(address, "colocated", None, None, healthy=True, info=pb.InfoReply())
    assert reason(colocated, "10.0.0.3:0", "prefill") == "mixed_deployment"


@pytest.mark.parametrize("worker_type, address, status, why", [("encoder", "10.0.0.2:0", 400, "unknown_role"),
                                                               ("prefill", "10.9.9.9:1", 404, "unknown_worker")])
def test_switch_role_names_the_reason(worker_type, address, status, why):
    with pytest.raises(SwitchRefused) as refused:
        asyncio.run(switch_role(pd_pool(), address, worker_type))
    assert (refused.value.status, refused.value.reason) == (status, why)
    assert f"(reason: {why})" in refused.value.message


class SwitchedWorkerStub:
    """A worker that another gateway switched to prefill: what it answers to this gateway's health checks."""

    async def Health(self, request, timeout=None, wait_for_ready=None):  # noqa: N802 (the stub's names)
        return pb.HealthReply(ok=True, role="prefill")

    async def Info(self, request, timeout=None):  # noqa: N802
        return pb.InfoReply(role="prefill", max_running_requests=7)

    async def Load(self, request, timeout=None):  # noqa: N802
        return pb.LoadReply()


def test_a_role_switched_elsewhere_is_learnt_at_the_next_health_check():
    pool = pd_pool(prefill=1, decode=2)
    worker = pool.workers["10.0.0.2:1"]
    worker.stub = SwitchedWorkerStub()
    assert asyncio.run(pool.check(worker))
    assert worker.role == "prefill" and worker.info.max_running_requests == 7  # its Info asked again
    assert worker in pool.healthy("prefill") and worker not in pool.healthy("decode")
