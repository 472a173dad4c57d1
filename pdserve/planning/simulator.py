"""Discrete-event simulation of a deployment serving a trace, on a virtual clock.

Every decision is the project's own code: the gateway's `Router` (cache-aware or round-robin) picks each request's
worker or pair, each worker's `Scheduler` with its `PageAllocator` and `RadixCache` picks every batch (sim_worker.py),
and only the time a step takes comes from the profile (costs.py). Events, in time order:

    arrival     the gateway routes the request (colocated: queued on its worker; PD: on its decode worker, which
                reserves the prompt's pages and then hands it to the prefill worker)
    step end    the worker books its batch; each decoding request gets a token; a prompt finished on a prefill
                worker has its KV sent (the prefill engine is busy for the transfer, as it is in the server)
    kv ready    the decode worker takes the prompt's KV and its first token
    wake        a worker that was transferring looks for work again

A worker idle with nothing to schedule sleeps until an event gives it work. The clock starts at the first arrival.

With a planner (`Deployment.planner`, PD only), the gateway's own policy (services/gateway/planner.py) decides every
`interval_s` from the window's TTFT and ITL and each worker's load, as the gateway's loop does (sim_planner.py).
A switch as the live one goes: the worker leaves its role's rotation at once, finishes the work it holds (a
prefill worker its prompts, a decode worker its running requests), is busy `switch_s`, then serves in the new
role with its prefix cache as it was.

    tick        the planner decides
    switched    a worker's switch is done: it takes requests of its new role
"""
from __future__ import annotations

import bisect
import gc
import heapq
import itertools
from dataclasses import dataclass, field

from pdserve.planning.costs import Costs
from pdserve.planning.sim_planner import Switch, observe
from pdserve.planning.sim_worker import SimWorker
from pdserve.planning.traces import TraceRequest, sim_prompt_ids
from pdserve.services.gateway.planner import Planner, PlannerSettings
from pdserve.services.gateway.workers.router import Router
from pdserve.shared.config import SchedulerConfig
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.sampling_params import SamplingParams

ARRIVE, STEP, KV, WAKE, TICK, SWITCHED = range(6)


@dataclass(frozen=True)
class Deployment:
    """The workers and the settings a simulated deployment runs with (the flags of `pdserve up` and the workers)."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    page_size: int | None = None  # None: the profile's
    max_total_tokens: int | None = None  # KV pool of each worker; None: the profile's
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    schedule_policy: str = "fcfs"
    mixed_prefill: bool = False
    routing_policy: str = "cache_aware"
    planner: PlannerSettings | None = None  # the SLO planner moves workers between prefill and decode
    switch_s: float = 1.0  # what a worker's role switch costs once it has finished its work

    def __post_init__(self) -> None:
        if self.planner is not None and self.colocated:
            raise ValueError("the planner moves workers between prefill and decode: give --prefill and --decode")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("give either --colocated K or --prefill N and --decode M, not both")
        if not self.colocated and not (self.prefill > 0 and self.decode > 0):
            raise ValueError("give --colocated K, or both --prefill N and --decode M (each >= 1)")
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated {self.colocated}"
        return f"PD {self.prefill}:{self.decode}" + (" + planner" if self.planner is not None else "")


@dataclass
class RequestTimes:
    arrival: float
    output_len: int
    first: float = -1.0  # first token leaves the gateway
    last: float = -1.0
    cached_tokens: int = 0


@dataclass
class SimResult:
    deployment: Deployment
    requests: list[RequestTimes]
    itls: list[float]  # every gap between two tokens of one request
    start: float
    end: float
    utilisation: dict[str, float] = field(default_factory=dict)  # role -> mean busy share of its workers
    steps: int = 0
    switches: list[Switch] = field(default_factory=list)


class _Pool:
    """The part of the gateway's WorkerPool the router reads."""

    def __init__(self, workers: list[SimWorker], colocated: bool) -> None:
        self.workers = workers
        self.mode = "colocated" if colocated else "pd"
        self.cache_role = "colocated" if colocated else "prefill"
        self.on_rejoin: list = []
        self.serving = {role: [w for w in workers if w.role == role] for role in ("colocated", "prefill", "decode")}

    def healthy(self, role: str) -> list[SimWorker]:
        return self.serving[role]


class _NoEvents:
    """The router's view of what workers say they hold: nothing, so it goes by its own routing history (a gateway
    whose workers stream no KV events). Streaming them here would cost more than the rest of the simulation."""

    def pages(self, address: str, hashes: list[int]) -> tuple[int, int, int]:
        return 0, 0, 0


class Simulation:
    def __init__(self, deployment: Deployment, costs: Costs) -> None:
        d = deployment
        self.deployment, self.costs = d, costs
        page_size = d.page_size or costs.page_size
        pages = (d.max_total_tokens or costs.max_total_tokens) // page_size
        config = SchedulerConfig(max_running_requests=d.max_running_requests, max_prefill_tokens=d.max_prefill_tokens,
                                 chunked_prefill_size=d.chunked_prefill_size, policy=d.schedule_policy,
                                 mixed_prefill=d.mixed_prefill)
        roles = [("colocated", d.colocated)] if d.colocated else [("prefill", d.prefill), ("decode", d.decode)]
        self.workers = [SimWorker(f"{role}-{i}", role, config, page_size, pages)
                        for role, count in roles for i in range(count)]
        self.pool = _Pool(self.workers, bool(d.colocated))
        self.router = Router(self.pool, policy=d.routing_policy)
        self.router.held = _NoEvents()
        self.events: list = []
        self._seq = itertools.count()
        self._params: dict[int, SamplingParams] = {}
        self.pairs: dict[str, tuple[int, SimWorker, SimWorker | None]] = {}  # rid -> (index, generating, prefill)
        self.owed: dict[SimWorker, set[str]] = {w: set() for w in self.workers}  # requests whose work there is due
        self.steps = 0
        self.planner = Planner(d.planner) if d.planner is not None else None
        self.leaving: dict[SimWorker, str] = {}  # worker -> the role it switches to, while it finishes its work
        self.switches: list[Switch] = []
        self.first_seen: list[tuple[float, float]] = []  # (when, TTFT) of each first token, in time order
        self.gaps: list[tuple[float, float, int]] = []  # (when, sum of gaps, tokens) per batch of tokens

    def push(self, when: float, kind: int, *args) -> None:
        heapq.heappush(self.events, (when, next(self._seq), kind, args))

    def run(self, trace: list[TraceRequest]) -> SimResult:
        self.times = [RequestTimes(r.arrival_s, r.output_len) for r in trace]
        self.itls: list[float] = []
        self.trace = trace
        for i, r in enumerate(trace):
            self.push(r.arrival_s + self.costs.request_s, ARRIVE, i)  # the gateway's work before routing
        if self.planner is not None and trace:
            self.push(trace[0].arrival_s + self.planner.settings.interval_s, TICK)
        now = 0.0
        while self.events:
            now, _, kind, args = heapq.heappop(self.events)
            if kind == ARRIVE:
                self.arrive(now, args[0])
            elif kind == STEP:
                self.step_end(now, *args)
            elif kind == KV:
                self.kv_ready(now, *args)
            elif kind == TICK:
                self.tick(now)
            elif kind == SWITCHED:
                self.switched(now, *args)
            else:
                self.kick(now, args[0])
        start = trace[0].arrival_s if trace else 0.0
        span = max(now - start, 1e-9)
        usage: dict[str, list[float]] = {}
        for w in self.workers:
            usage.setdefault(w.role, []).append(w.busy_s / span)
        return SimResult(self.deployment, self.times, self.itls, start, now,
                         {role: sum(u) / len(u) for role, u in usage.items()}, self.steps, self.switches)

    # ------------------------------------------------------------ events
    def arrive(self, now: float, index: int) -> None:
        r = self.trace[index]
        if r.output_len < 1:
            self.times[index].first = self.times[index].last = now
            return
        params = self.params(r.output_len)
        ids = sim_prompt_ids(r, index)
        for w in self.workers:
            w.refresh(now)
        pair = self.router.choose(ids)
        rid = str(index)
        for w in pair.workers:
            w.in_flight += 1
            self.owed[w].add(rid)
        self.pairs[rid] = (index, pair.generate, pair.prefill)
        self.interrupt(now, pair.generate)
        pair.generate.queue(Req(rid=rid, input_ids=ids, params=params, arrival=now))
        self.kick(now, pair.generate)

    def kick(self, now: float, worker: SimWorker) -> None:
        """Start the worker's next step if it is free and has one."""
        if worker.batch is not None or worker.busy_until > now:
            return
        if worker in self.leaving and not self.owed[worker]:  # its work is done: the switch proper
            worker.busy_until = now + self.deployment.switch_s
            self.push(worker.busy_until, SWITCHED, worker, self.leaving.pop(worker))
            return
        if worker.role == "decode":
            for req in worker.reserve():
                prefill = self.pairs[req.rid][2]
                prefill.queue(Req(rid=req.rid, input_ids=req.input_ids, params=self.params(1), arrival=now))
                self.kick(now, prefill)
        batch = worker.schedule()
        if batch is None:
            return
        c = self.costs
        if batch.is_decode:
            context, size = sum(r.seq_len for r in batch.reqs), len(batch)
            ends, end = [], now
            for i in range(worker.decode_run(batch)):
                end += c.decode_s(size, context + i * size)
                ends.append(end)
        else:
            parts = list(zip(batch.reqs, batch.extend_lens))
            chunks = [(n, r.num_computed) for r, n in parts if r.status != ReqStatus.RUNNING]
            decoding = [r for r, _ in parts if r.status == ReqStatus.RUNNING]  # a mixed step's decode part
            ends = [now + c.prefill_s(chunks) + c.decode_extra_s(len(decoding), sum(r.seq_len for r in decoding))]
        worker.batch, worker.ends, worker.started = batch, ends, now
        self._launch(worker)

    def _launch(self, worker: SimWorker) -> None:
        worker.busy_until = worker.ends[-1]
        worker.run_id += 1
        self.push(worker.ends[-1], STEP, worker, worker.run_id)

    def interrupt(self, now: float, worker: SimWorker) -> None:
        """Something for `worker` arrived: a run of decode steps ends with the step in progress, so that the
        worker looks at it from the next step on, as the engine does between two steps."""
        ends = worker.ends
        if worker.batch is None or len(ends) < 2:
            return
        keep = bisect.bisect_right(ends, now) + 1
        if keep < len(ends):
            del ends[keep:]
            self._launch(worker)

    def params(self, output_len: int) -> SamplingParams:
        params = self._params.get(output_len)
        if params is None:
            params = self._params[output_len] = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
        return params

    def step_end(self, now: float, worker: SimWorker, run_id: int) -> None:
        if run_id != worker.run_id:
            return  # a run of steps cut short by `interrupt`: its end was moved
        batch, worker.batch = worker.batch, None
        worker.busy_s += now - worker.started
        self.steps += len(worker.ends)
        if batch.is_decode:
            self.decode_tokens(worker, batch, worker.ends)
            self.kick(now, worker)
            return
        tokens, done = worker.account(batch)
        for req in tokens:
            self.token(now, worker, req)
        spent = 0.0
        for req in done:  # a prefill worker writes each finished prompt's KV, one after the other
            spent += self.costs.transfer_s(len(req.input_ids))
            decode = self.pairs[req.rid][1]
            worker.scheduler.remove(req, cache=True)
            self.owed[worker].discard(req.rid)
            self.push(now + spent, KV, decode, req.rid, req.cached_tokens)
        if spent:
            worker.busy_until = now + spent
            worker.busy_s += spent
            self.push(now + spent, WAKE, worker)
        else:
            self.kick(now, worker)

    def decode_tokens(self, worker: SimWorker, batch, ends: list[float]) -> None:
        """The tokens of a run of decode steps: one per request at the end of each step."""
        seen = [end + self.costs.token_s for end in ends]
        gaps = [b - a for a, b in zip(seen, seen[1:])]
        for req in batch.reqs:
            index, generating, prefill = self.pairs[req.rid]
            t = self.times[index]
            self.gaps.append((seen[-1], seen[-1] - t.last, len(ends)))
            self.itls.append(seen[0] - t.last)
            self.itls.extend(gaps)
            t.last = seen[-1]
            req.num_computed += len(ends)  # each step computed the KV of the token before
            if worker.append_tokens(req, len(ends)):
                self.finished(req.rid)

    def kv_ready(self, now: float, decode: SimWorker, rid: str, cached_tokens: int) -> None:
        self.interrupt(now, decode)
        req = decode.kv_ready(rid)
        req.cached_tokens = cached_tokens
        self.token(now, decode, req)
        self.kick(now, decode)

    def token(self, now: float, worker: SimWorker, req: Req) -> None:
        index, generating, prefill = self.pairs[req.rid]
        t = self.times[index]
        seen = now + self.costs.token_s
        if t.first < 0:
            t.first, t.cached_tokens = seen, req.cached_tokens
            self.first_seen.append((seen, seen - t.arrival))
        else:
            self.itls.append(seen - t.last)
            self.gaps.append((seen, seen - t.last, 1))
        t.last = seen
        if worker.append_tokens(req, 1):
            self.finished(req.rid)

    def finished(self, rid: str) -> None:
        _, generating, prefill = self.pairs.pop(rid)
        generating.in_flight -= 1
        self.owed[generating].discard(rid)
        if prefill is not None:
            prefill.in_flight -= 1
            self.owed[prefill].discard(rid)
        when = self.times[int(rid)].last
        for worker in (generating, prefill):
            if worker in self.leaving and not self.owed[worker] and worker.batch is None:
                self.kick(max(when, worker.busy_until), worker)  # its last request is done: the switch begins

    # ------------------------------------------------------------ the planner
    def tick(self, now: float) -> None:
        d = self.planner.decide(observe(self, now))
        for worker in [w for w in self.workers if w.address in d.addresses and not self.planner.settings.dry_run]:
            self.pool.serving[worker.role].remove(worker)  # no new work of its old role from now on
            self.leaving[worker] = d.target
            self.switches.append(Switch(now, worker.address, d.source, d.target, d.reason))
            self.kick(now, worker)
        if self.events:  # while anything is left to happen
            self.push(now + self.planner.settings.interval_s, TICK)

    def switched(self, now: float, worker: SimWorker, role: str) -> None:
        worker.role = role
        self.pool.serving[worker.role].append(worker)
        next(s for s in reversed(self.switches) if s.address == worker.address).done = now
        self.kick(now, worker)


def simulate(deployment: Deployment, costs: Costs, trace: list[TraceRequest]) -> SimResult:
    # A fleet's prefix trees hold millions of nodes made at a high rate: at the collector's usual thresholds
    # its passes over them took most of an hour-long simulation's time. Nothing here relies on prompt collection.
    thresholds = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        return Simulation(deployment, costs).run(trace)
    finally:
        gc.set_threshold(*thresholds)
