"""A worker's live role switch, its front side (SwitchRole): a prefill worker becomes a decode worker or the other
way round in the same processes, with its weights, prefix cache and KV tiers as they are.

Lifecycle of one switch, one at a time:
1. refused, with a named reason, where it cannot be done (`refusal`);
2. drain: Health says draining, so the gateways route no new work here, and new Generate calls are refused
   UNAVAILABLE (the gateway sends them to another pair); Prefill calls decode workers already sent are still
   served. What runs finishes, for up to the drain timeout; a decode worker's generations still running then go to
   `evacuate`, the one hook for moving them (by default they end UNAVAILABLE, which the gateway continues on
   another pair from the tokens it streamed);
3. the engine takes the new role once it holds no request (`SwitchRole` on the engine channel);
4. the front takes the new role's wiring (a decode worker registers with the prefill workers it was given), and
   answers: Health reports the new role and ready, so every gateway learns it at its next check.
The KV transfer agent a worker starts with serves either direction, so no endpoint is made or closed here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.worker.channel.messages import Abort, SwitchRole
from pdserve.services.worker.channel.wire import EngineGone, RemoteError
from pdserve.shared.config import Role

log = logging.getLogger("pdserve.worker")
DRAIN_TIMEOUT_S = 5.0  # for the running requests to finish, unless the call says otherwise
ENGINE_WAIT_S = 10.0  # for the engine to hold no request once the front's calls are done
REGISTER_S = 5.0  # a new decode worker's registrations with the prefill workers it is given


class Refused(Exception):
    """A switch that cannot be done: `reason` names it (FAILED_PRECONDITION "<reason>: <message>")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")


class RoleSwitch:
    def __init__(self, app, service, pooling, wiring_for: Callable[[Role], object]) -> None:
        """`app`: the WorkerApp (its `wiring`, `info`, `calls`, `link`); `service`: its WorkerService; `pooling`:
        its PoolingService, whose refusal follows the role; `wiring_for`: a role's wiring."""
        self.app, self.service, self.pooling, self.wiring_for = app, service, pooling, wiring_for
        self.running = False
        # The hook a decode worker's generations still running at the drain's end go to: it returns how many it
        # moved. Default: end them UNAVAILABLE, which the gateway continues elsewhere.
        self.evacuate: Callable[[list[str]], Awaitable[int]] = self._end_for_gateway

    def refusal(self, role: str) -> Refused | None:
        app = self.app
        if role not in {r.value for r in Role}:
            return Refused("unknown_role", f"{role!r} is no role: prefill or decode")
        if not (app.wiring.switches_roles and self.wiring_for(Role(role)).switches_roles):
            return Refused("colocated_worker", "only prefill and decode workers switch roles: a colocated worker "
                                               "moves no KV")
        if app.engine_info.get("pooled"):
            return Refused("embedding_worker", "an embedding or scoring model has no prefill or decode role")
        if self.running:
            return Refused("switch_in_progress", f"this worker is switching to {role} already")
        if type(self.wiring_for(Role(role))) is type(app.wiring):
            return Refused("same_role", f"this worker is a {role} worker already")
        if app.calls.draining:
            return Refused("shutting_down", "this worker is shutting down")
        return None

    async def __call__(self, request: pb.SwitchRoleRequest, context) -> pb.SwitchRoleReply:
        refused = self.refusal(request.role)
        if refused is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(refused))
        started, self.running = time.monotonic(), True
        try:
            moved = await self._drain(request.drain_timeout_s or DRAIN_TIMEOUT_S)
            info = await self.app.link.call(SwitchRole(request.role, ENGINE_WAIT_S), ENGINE_WAIT_S + 5)
            await self._rewire(Role(request.role), info, list(request.prefill_addrs))
        except RemoteError as exc:
            if "drain_timeout:" not in str(exc):
                raise
            # Nothing changed: it serves in its old role again, and the caller may try later.
            log.warning("not switched to the %s role: %s", request.role, exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"drain_timeout: it still held requests after {ENGINE_WAIT_S:g} s, so it stays a "
                                f"{self.app.wiring.role.value} worker")
        except (EngineGone, asyncio.TimeoutError) as exc:
            log.error("switching to the %s role failed: %s", request.role, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the switch to {request.role} failed: {exc}")
        finally:
            self.running = False
            self.app.calls.draining = False  # serving again, in whichever role the worker holds now
        seconds = time.monotonic() - started
        log.info("now a %s worker (switched in %.2f s; %d generation(s) moved)", request.role, seconds, moved)
        return pb.SwitchRoleReply(info=self.app.info, seconds=seconds, moved=moved)

    async def _drain(self, timeout_s: float) -> int:
        calls = self.app.calls
        calls.draining = True
        if await calls.wait_idle(timeout_s):
            return 0
        return await self.evacuate(self.app.link.watched())

    async def _end_for_gateway(self, rids: list[str]) -> int:
        """End the generations still running UNAVAILABLE (a decode worker's failure code), for the gateway to
        continue each on another pair; then wait for their calls to end."""
        found = await self.app.link.call(Abort(rids, "this worker is switching roles: continued on another"))
        await self.app.calls.wait_idle(ENGINE_WAIT_S)
        return len(found)

    async def _rewire(self, role: Role, info: dict, prefill_addrs: list[str]) -> None:
        app, old, new = self.app, self.app.wiring, self.wiring_for(role)
        app.engine_info = info
        await new.serve(app, None, app.calls)
        await old.stop()
        app.wiring = self.service.wiring = new
        app.info.role = role.value
        self.pooling.refusal = new.refuses_pooling
        if prefill_addrs:
            await new.register(prefill_addrs, REGISTER_S)
