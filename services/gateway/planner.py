"""The SLO planner's policy: from what the deployment showed over the last window, which side will miss its
target, and whether giving it one worker of the other side fixes that without making the other side miss.

Pure: no clock, no I/O. `Planner.decide(observation)` runs once per tick (the gateway's loop in
workers/planning.py, or the simulator) and returns a `Decision`: a switch, or a hold, each with its reason.

Pressure: each side's figures as a share of its target, 1.0 being exactly at it.

    prefill   TTFT / TTFT SLO, prompts waiting per prefill worker / queue limit
    decode    ITL / ITL SLO, KV pool use / pool limit, requests waiting per decode worker / queue limit

In PD a prompt also waits for the decode worker's pages and slots before it is computed, so a TTFT miss while
decode's queue or pool is past its limit is decode's, not prefill's. The prediction for the side that gives a
worker: its load spreads over n - 1 workers, so queues, pool use and TTFT scale by n / (n - 1); ITL only in its
part that grows with the batch (a decode step's fixed cost stays: `itl_knee_batch`).

What the planner guarantees:
- it switches only when a side has been at or past `high` for `sustain` ticks in a row (one bad window is
  noise), and the other side, the workers down, is predicted at or below `low` (hysteresis: `low < high`, so the
  switch never leaves the other side calling for the workers back). One decision moves as many workers as the
  needy side wants (what would bring it to `low`) and the other side can spare so, at most a quarter of that side
  (one at a time, 64 workers would take a phase to follow a change of load; all at once over-reacts);
- no role falls below `min_per_role` workers;
- a worker that changed role keeps it for `dwell_s`, and after any switch none follows for `cooldown_s` (the
  window must see the new split before it is judged).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")
REASONS = ("ttft", "prefill_queue", "itl", "kv_pool", "decode_queue")  # why a side is under pressure


@dataclass(frozen=True)
class PlannerSettings:
    ttft_slo_s: float
    itl_slo_s: float
    window_s: float = 30.0  # the figures a decision reads: the last window_s of requests
    interval_s: float = 5.0  # between two decisions
    high: float = 1.0  # a side at or past this pressure is predicted to miss its target
    low: float = 0.8  # the giving side must be predicted at or below this after the switch
    sustain: int = 2  # decisions in a row a side must be at `high` before it gets a worker
    dwell_s: float = 60.0  # a worker keeps a new role at least this long
    cooldown_s: float | None = None  # after any switch, none for this long (None: window_s)
    min_per_role: int = 1
    queue_limit: float = 4.0  # requests waiting per worker at which a side is at its target
    pool_limit: float = 0.9  # decode's KV pool use at which it is at its target
    # Requests per decode worker at which a decode step costs twice what one request's does (about 8 on a CPU;
    # far more on a GPU, where a step is bound by reading the weights): how ITL grows as a decode worker goes.
    itl_knee_batch: float = 8.0
    dry_run: bool = False  # decide and say so, switch nothing

    def __post_init__(self) -> None:
        problems = [f"{name} must be > 0, got {value}" for name, value in
                    (("the TTFT SLO", self.ttft_slo_s), ("the ITL SLO", self.itl_slo_s),
                     ("the planner's window", self.window_s), ("the planner's interval", self.interval_s),
                     ("the queue limit", self.queue_limit), ("the pool limit", self.pool_limit),
                     ("the ITL knee batch", self.itl_knee_batch)) if not value > 0]
        if not 0 < self.low < self.high:
            problems.append(f"the planner's thresholds need 0 < low < high, got low {self.low}, high {self.high}")
        if self.sustain < 1 or self.min_per_role < 1 or self.dwell_s < 0 or (self.cooldown_s or 0) < 0:
            problems.append("sustain and min_per_role must be >= 1, dwell and cooldown >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def cooldown(self) -> float:
        return self.window_s if self.cooldown_s is None else self.cooldown_s


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    running: int = 0
    waiting: int = 0
    pool_use: float = 0.0  # share of its KV pool in use, 0..1


@dataclass(frozen=True)
class Observation:
    now: float  # seconds, any monotonic origin
    ttft_s: float | None  # the window's TTFT (p90), None without a first token in it
    itl_s: float | None  # the window's mean inter-token latency, None without one
    prefill: tuple[WorkerLoad, ...]
    decode: tuple[WorkerLoad, ...]

    def workers(self, role: str) -> tuple[WorkerLoad, ...]:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Pressure:
    value: float
    reason: str  # the figure that set it, one of REASONS
    scaled: float = 0.0  # the part that grows as n / (n - k) with k workers less: queues, pool use, TTFT
    itl: float = 0.0  # decode: ITL / its SLO, whose part per request grows with the batch
    batch: float = 0.0  # decode: requests running per worker

    def after(self, n: int, k: int, knee: float) -> float:
        """Predicted with `k` of the side's `n` workers gone."""
        if k >= n:
            return math.inf
        grow = n / (n - k)
        itl = self.itl * (knee + self.batch * grow) / (knee + self.batch) if self.itl else 0.0
        return max(self.scaled * grow, itl)


@dataclass(frozen=True)
class Decision:
    action: str  # "switch" or "hold"
    reason: str  # switch: one of REASONS; hold: within_slo, sustaining, cooldown, dwell, floor, other_side_busy
    detail: str  # one sentence with the figures
    now: float
    pressure: dict[str, float] = field(default_factory=dict)
    source: str | None = None  # switch: the role the worker leaves
    target: str | None = None
    addresses: tuple[str, ...] = ()  # switch: the workers that change role, least busy first

    def as_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "detail": self.detail, "from": self.source,
                "to": self.target, "addresses": list(self.addresses), "pressure": self.pressure}


def pressures(obs: Observation, s: PlannerSettings) -> dict[str, Pressure]:
    """Each side's pressure, the figure behind it, and what predicts it with fewer workers."""
    def per_worker(workers: tuple[WorkerLoad, ...]) -> float:
        return sum(w.waiting for w in workers) / max(1, len(workers)) / s.queue_limit

    ttft = (obs.ttft_s or 0.0) / s.ttft_slo_s
    pool = max((w.pool_use for w in obs.decode), default=0.0) / s.pool_limit
    prefill_queue = per_worker(obs.prefill)
    # A decode worker holds a slot for each prompt it waits for: while prompts queue on prefill, decode's own
    # queue is their effect, not a want of decode workers.
    decode_queue = per_worker(obs.decode) if prefill_queue < s.high else 0.0
    decode_bound = decode_queue >= s.high or pool >= s.high  # prompts wait for decode's slots or pages
    prefill_ttft = 0.0 if decode_bound else ttft
    prefill = max((prefill_queue, "prefill_queue"), (prefill_ttft, "ttft"))
    bound = "kv_pool" if pool >= max(s.high, decode_queue) else "decode_queue"  # what the prompts wait for
    waits = max(pool, decode_queue, ttft if decode_bound else 0.0)
    itl = (obs.itl_s or 0.0) / s.itl_slo_s
    decode = max((itl, "itl"), (pool, "kv_pool"), (decode_queue, "decode_queue"),
                 (ttft if decode_bound else 0.0, bound))
    # A decode step costs a fixed part and a part per request in the batch: only the latter grows with the load.
    batch = sum(w.running for w in obs.decode) / max(1, len(obs.decode))
    return {"prefill": Pressure(*prefill, scaled=prefill[0]), "decode": Pressure(*decode, waits, itl, batch)}


def wanted(count: int, pressure: float, s: PlannerSettings) -> int:
    """Workers of a side that would bring it to `low`: what an autoscaler adding pods would aim for."""
    return max(s.min_per_role, math.ceil(count * pressure / s.low - 1e-9))


class Planner:
    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings
        self.last_switch = -math.inf
        self.changed: dict[str, float] = {}  # address -> when it took its present role
        self.breaching: dict[str, int] = {role: 0 for role in ROLES}  # decisions in a row at `high`
        self.desired: dict[str, int] = {}

    def decide(self, obs: Observation) -> Decision:
        s = self.settings
        found = pressures(obs, s)
        shown = {role: round(p.value, 3) for role, p in found.items()}
        counts = {role: len(obs.workers(role)) for role in ROLES}
        self.desired = {role: wanted(counts[role], found[role].value, s) for role in ROLES}
        for role in ROLES:
            self.breaching[role] = self.breaching[role] + 1 if found[role].value >= s.high else 0

        def hold(reason: str, detail: str) -> Decision:
            return Decision("hold", reason, detail, obs.now, shown)

        needy = max(ROLES, key=lambda role: found[role].value)
        if found[needy].value < s.high:
            return hold("within_slo", f"both sides within target (prefill {shown['prefill']}, decode "
                                      f"{shown['decode']})")
        why = found[needy].reason
        if self.breaching[needy] < s.sustain:
            return hold("sustaining", f"{needy} at {shown[needy]} of its target ({why}) for "
                                      f"{self.breaching[needy]} of {s.sustain} decisions")
        if obs.now - self.last_switch < s.cooldown:
            return hold("cooldown", f"{needy} at {shown[needy]} ({why}), but the last switch was "
                                    f"{obs.now - self.last_switch:.0f} s ago (cooldown {s.cooldown:g} s)")
        giver = "decode" if needy == "prefill" else "prefill"
        if counts[giver] <= s.min_per_role:
            return hold("floor", f"{needy} at {shown[needy]} ({why}), but {giver} has {counts[giver]} worker(s), "
                                 f"the least it may have: more workers are needed")
        after = found[giver].after(counts[giver], 1, s.itl_knee_batch)
        if after > s.low:
            return hold("other_side_busy", f"{needy} at {shown[needy]} ({why}), but {giver} one worker down would "
                                           f"be at {after:.2f} (> {s.low:g}): more workers are needed")
        free = sorted((w for w in obs.workers(giver) if obs.now - self.changed.get(w.address, -math.inf) >= s.dwell_s),
                      key=lambda w: (w.running + w.waiting, w.pool_use, w.address))
        if not free:
            return hold("dwell", f"{needy} at {shown[needy]} ({why}), but every {giver} worker changed role less "
                                 f"than {s.dwell_s:g} s ago")
        # As many as the needy side wants, the giver can spare (staying at `low`, above its floor) and may move.
        k, most = 1, min(len(free), self.desired[needy] - counts[needy], counts[giver] - s.min_per_role,
                         math.ceil(counts[giver] / 4))  # a quarter of the giving side at most: a latency window
        while (k < most
               and found[giver].after(counts[giver], k + 1, s.itl_knee_batch) <= s.low):
            k += 1
        after = found[giver].after(counts[giver], k, s.itl_knee_batch)
        chosen = tuple(w.address for w in free[:k])
        self.last_switch = obs.now
        self.changed.update(dict.fromkeys(chosen, obs.now))
        self.breaching = {role: 0 for role in ROLES}
        return Decision("switch", why, f"{needy} at {shown[needy]} of its target ({why}); {giver} predicted at "
                                       f"{after:.2f} with {k} worker(s) less: {', '.join(chosen)} {giver} -> {needy}",
                        obs.now, shown, giver, needy, chosen)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--planner", default="off", choices=["off", "slo"],
                        help="slo: move workers between prefill and decode (live role switch) to keep TTFT within "
                             "--ttft-slo-ms and ITL within --itl-slo-ms; every decision is logged, counted "
                             "(pdserve_planner_*) and shown on the status page")
    parser.add_argument("--ttft-slo-ms", type=float, default=None, help="the planner's time-to-first-token target")
    parser.add_argument("--itl-slo-ms", type=float, default=None, help="the planner's inter-token latency target")
    parser.add_argument("--planner-dry-run", action="store_true",
                        help="the planner decides and logs what it would switch, and switches nothing")
    parser.add_argument("--planner-interval-s", type=float, default=5.0, help="seconds between two decisions")
    parser.add_argument("--planner-window-s", type=float, default=30.0,
                        help="the seconds of TTFT and ITL a decision reads; after a switch none follows for as long")
    parser.add_argument("--planner-dwell-s", type=float, default=60.0,
                        help="a worker keeps a role the planner gave it at least this long")
    parser.add_argument("--planner-min-per-role", type=int, default=1, help="workers of each role the planner "
                        "always leaves")
    parser.add_argument("--planner-itl-knee-batch", type=float, default=8.0,
                        help="requests per decode worker at which a decode step costs twice one request's (about 8 "
                             "on a CPU, far more on a GPU): how the planner predicts ITL with one decode worker less")


def from_args(args: argparse.Namespace) -> PlannerSettings | None:
    """The planner's settings (None with --planner off); ValueError naming the flag for what cannot work."""
    if args.planner == "off":
        return None
    if args.ttft_slo_ms is None or args.itl_slo_ms is None:
        raise ValueError("--planner slo needs --ttft-slo-ms and --itl-slo-ms")
    return PlannerSettings(args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3, window_s=args.planner_window_s,
                           interval_s=args.planner_interval_s, dwell_s=args.planner_dwell_s,
                           min_per_role=args.planner_min_per_role, itl_knee_batch=args.planner_itl_knee_batch,
                           dry_run=args.planner_dry_run)
