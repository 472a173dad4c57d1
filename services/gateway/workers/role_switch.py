"""A worker's live role switch, as the gateway drives it: checks, the worker's SwitchRole call, and the pool's view.

`switch_role` refuses what cannot be done before the worker is asked (an unknown worker or role, a worker that is
not serving, an embedding worker, a switch that would leave the deployment without a worker of a role, a switch
already under way on that worker), then asks the worker to switch and waits until it serves in its new role. The
pool's record of the worker takes the new role only then, so the router never sends a request of the new role to a
worker that has not finished switching, and the old role's requests stop reaching it as soon as the switch begins.
"""
from __future__ import annotations

import time

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers.pool import Worker, WorkerPool

# SGLang's model gateway names a colocated worker "regular"; the pool's own role names are accepted too.
WORKER_TYPES = {"prefill": "prefill", "decode": "decode", "regular": "colocated", "colocated": "colocated"}
SWITCH_TIMEOUT_S = 60.0  # the worker bounds its own drain tighter (front/role_switch.py: 5 s, then 10 s)


def worker_type(role: str) -> str:
    """The SGLang name of a pool role."""
    return "regular" if role == "colocated" else role


class SwitchRefused(ApiError):
    """A refusal with a named `reason` (e.g. "last_of_role"), which the planner and the API's client read."""

    def __init__(self, status: int, reason: str, message: str, param: str | None = None) -> None:
        super().__init__(status, f"{message} (reason: {reason})", param)
        self.reason = reason


async def switch_role(pool: WorkerPool, address: str, worker_type: str) -> float:
    """Switch the worker at `address` to `worker_type` ("prefill", "decode" or "regular"): the seconds it took,
    measured from the call until the worker serves in its new role. Raises SwitchRefused (an ApiError) with a
    named reason otherwise: those of `refusal`, the worker's own, "drain_timeout" (503: it still held requests,
    and serves in its old role again) and "worker_lost" (503: it failed or died during the switch, and is out of
    rotation by the time this raises)."""
    role = WORKER_TYPES.get(worker_type)
    if role is None:
        raise SwitchRefused(400, "unknown_role", f"'worker_type' must be one of prefill, decode, regular; got "
                                                 f"{worker_type!r}.", "worker_type")
    worker = pool.workers.get(address)
    if worker is None:
        raise SwitchRefused(404, "unknown_worker", f"No worker at {address!r}; GET /workers lists them.", "url")
    refused = refusal(pool, worker, role)
    if refused is not None:
        raise refused
    started = time.monotonic()
    worker.switching = True  # out of the pool's views at once: no new request of the old role goes to it
    try:
        prefills = [w.address for w in pool.healthy("prefill")] if role == "decode" else []
        try:
            reply = await _ask(worker, role, prefills)
        except SwitchRefused as refused:
            if refused.reason == "worker_lost":
                await pool.probe(worker)  # taken out at once if it is gone
            else:
                await pool.check(worker)  # it serves in its old role again: back in rotation at once
            raise
        # Known at once: the router picks the worker for its new role from the next request on.
        worker.role, worker.info = role, reply.info
        await pool.check(worker)
    finally:
        worker.switching = False
    return time.monotonic() - started


def refusal(pool: WorkerPool, worker: Worker, role: str) -> SwitchRefused | None:
    """Why `worker` cannot switch to `role` now, or None."""
    if worker.switching:
        return SwitchRefused(409, "switch_in_progress", f"Worker {worker.address} is switching roles already.")
    if not worker.healthy or worker.info is None:
        return SwitchRefused(503, "worker_not_serving", f"Worker {worker.address} is not serving: "
                                                        f"{worker.last_error or 'not checked yet'}.")
    if worker.role == role:
        return SwitchRefused(400, "same_role", f"Worker {worker.address} is a {worker_type_of(worker)} worker "
                                               "already.", "worker_type")
    if pool.mode == "pd" and role == "colocated" or pool.mode == "colocated" and role != "colocated":
        return SwitchRefused(400, "mixed_deployment", f"This deployment runs {pool.mode} workers; a "
                                                      f"{'regular' if role == 'colocated' else role} worker has "
                                                      "no peers to serve with in it.", "worker_type")
    others = [w for w in pool.of_role(worker.role) if w is not worker and w.healthy]
    if not others:
        return SwitchRefused(400, "last_of_role", f"Worker {worker.address} is the deployment's last serving "
                                                  f"{worker_type_of(worker)} worker; switching it would leave "
                                                  "none.")
    return None


def worker_type_of(worker: Worker) -> str:
    return worker_type(worker.role)


async def _ask(worker: Worker, role: str, prefill_addrs: list[str]) -> pb.SwitchRoleReply:
    try:
        reply = await worker.stub.SwitchRole(pb.SwitchRoleRequest(role=role, prefill_addrs=prefill_addrs),
                                             timeout=SWITCH_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the worker refused: its details name the reason
            reason, _, message = (exc.details() or "refused: ").partition(": ")
            status = {"switch_in_progress": 409, "drain_timeout": 503}.get(reason, 400)
            raise SwitchRefused(status, reason, f"Worker {worker.address}: {message or reason}.") from None
        raise SwitchRefused(503, "worker_lost", f"Worker {worker.address} failed during the switch: "
                                                f"{exc.details() or exc.code().name}.") from None
    return reply
