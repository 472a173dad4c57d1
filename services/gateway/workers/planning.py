"""The SLO planner at work in the gateway (--planner slo): every `interval_s` it reads the last window of TTFT and
ITL (the gateway's own, as clients see them) and each worker's last Load answer, asks the policy (planner.py) for a
decision, and carries it out through the live role switch (role_switch.py), or with --planner-dry-run only says
what the switch would be and whether the worker would take it.

Every decision is logged: a switch (made, refused or dry) at INFO, a hold at INFO when its reason changes and at
DEBUG while it stays the same. Switches are counted by role and reason; the counts of each role the planner would
want, and each side's pressure, are gauges (an HPA or KEDA reads them to add pods). The last decisions are kept
for the status page. One planner per gateway: with several gateway processes, the first one runs it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.planner import ROLES, Decision, Observation, Planner, PlannerSettings, WorkerLoad
from pdserve.services.gateway.workers.pool import Worker, WorkerPool
from pdserve.services.gateway.workers.role_switch import refusal, switch_role

log = logging.getLogger("pdserve.gateway.planner")
KEPT = 50  # decisions kept for the status page


def worker_load(w: Worker) -> WorkerLoad:
    load = w.load
    if load is None:
        return WorkerLoad(w.address)
    use = (load.total_pages - load.free_pages) / load.total_pages if load.total_pages else 0.0
    return WorkerLoad(w.address, load.running, load.waiting, use)


class PlannerLoop:
    def __init__(self, settings: PlannerSettings, pool: WorkerPool, metrics: GatewayMetrics, switch=switch_role):
        if pool.mode != "pd":
            raise ValueError("--planner slo moves workers between prefill and decode: give --prefill and --decode "
                             "workers, not colocated ones")
        self.settings, self.pool, self.metrics, self.switch = settings, pool, metrics, switch
        self.planner = Planner(settings)
        self.decisions: deque[dict] = deque(maxlen=KEPT)  # newest last, each with what came of it
        self._last_reason = ""
        self._task: asyncio.Task | None = None

    def observe(self) -> Observation:
        """The window's figures; a worker in the middle of a switch counts on neither side."""
        now = time.perf_counter()  # the clock the gateway's token timer stamps samples with
        since = now - self.settings.window_s
        workers = {role: tuple(worker_load(w) for w in self.pool.healthy(role) if not getattr(w, "switching", False))
                   for role in ROLES}
        recent = self.metrics.recent
        return Observation(now, recent.ttft_quantile(since), recent.itl_mean(since), workers["prefill"],
                           workers["decode"])

    async def tick(self) -> Decision:
        decision = self.planner.decide(self.observe())
        for role in ROLES:
            self.metrics.desired_workers.labels(role).set(self.planner.desired[role])
            self.metrics.pressure.labels(role).set(decision.pressure[role])
        entry = {"time": time.time(), **decision.as_dict(), "outcome": None}
        if decision.action == "switch":
            entry["outcome"] = await self.carry_out(decision)
        elif decision.reason != self._last_reason:
            log.info("planner: hold (%s): %s", decision.reason, decision.detail)
        else:
            log.debug("planner: hold (%s): %s", decision.reason, decision.detail)
        self._last_reason = decision.reason
        self.decisions.append(entry)
        return decision

    async def carry_out(self, d: Decision) -> str:
        """Each worker of the decision switched in turn; what came of it, in words."""
        labels = (d.source, d.target, d.reason)
        if self.settings.dry_run:
            refused = [f"{a}: {r.message}" for a in d.addresses if (w := self.pool.workers.get(a)) is not None
                       and (r := refusal(self.pool, w, d.target)) is not None]
            outcome = (f"dry run: the switch would be refused ({'; '.join(refused)})" if refused
                       else "dry run: not switched")
            self.metrics.dry_run_switches.labels(*labels).inc(len(d.addresses))
            log.info("planner: would switch %s %s -> %s (%s): %s; %s", ", ".join(d.addresses), d.source, d.target,
                     d.reason, d.detail, outcome)
            return outcome
        outcomes = []
        for address in d.addresses:
            try:
                seconds = await self.switch(self.pool, address, d.target)
            except ApiError as exc:
                log.warning("planner: switching %s %s -> %s (%s) failed: %s", address, d.source, d.target, d.reason,
                            exc.message)
                outcomes.append(f"failed: {exc.message}" if len(d.addresses) == 1 else f"{address} failed: "
                                                                                      f"{exc.message}")
                continue
            self.metrics.role_switches.labels(*labels).inc()
            log.info("planner: switched %s %s -> %s in %.1f s (%s): %s", address, d.source, d.target, seconds,
                     d.reason, d.detail)
            outcomes.append(f"switched in {seconds:.1f} s" if len(d.addresses) == 1 else f"{address} switched in "
                                                                                         f"{seconds:.1f} s")
        return "; ".join(outcomes)

    def describe(self) -> dict:
        s = self.settings
        return {"dry_run": s.dry_run, "ttft_slo_s": s.ttft_slo_s, "itl_slo_s": s.itl_slo_s, "window_s": s.window_s,
                "interval_s": s.interval_s, "dwell_s": s.dwell_s, "desired": self.planner.desired,
                "decisions": list(self.decisions)[::-1]}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except Exception:  # the planner must outlive any one round
                log.exception("planner round failed")

    async def lifecycle(self, app):
        """For the app's cleanup_ctx: runs while the gateway serves."""
        log.info("planner: SLO TTFT %g ms, ITL %g ms%s", self.settings.ttft_slo_s * 1e3,
                 self.settings.itl_slo_s * 1e3, " (dry run: it switches nothing)" if self.settings.dry_run else "")
        self._task = asyncio.create_task(self.run(), name="planner")
        yield
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
