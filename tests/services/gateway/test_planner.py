"""The SLO planner's policy on observations made by hand (no processes): when it switches, which worker, why,
and when it holds (hysteresis, dwell, cooldown, the floor of one worker per role)."""
from __future__ import annotations

import time

import pytest

from pdserve.services.gateway.planner import Observation, Planner, PlannerSettings, WorkerLoad

SLO = dict(ttft_slo_s=1.0, itl_slo_s=0.05)


def observe(now: float, ttft: float | None = 0.2, itl: float | None = 0.01, prefill: int = 1, decode: int = 2,
            decode_waiting: int = 0, pool_use: float = 0.1, busy: dict[str, int] | None = None) -> Observation:
    busy = busy or {}
    return Observation(now, ttft, itl,
                       tuple(WorkerLoad(f"p{i}", running=busy.get(f"p{i}", 0)) for i in range(prefill)),
                       tuple(WorkerLoad(f"d{i}", running=busy.get(f"d{i}", 0), waiting=decode_waiting,
                                        pool_use=pool_use) for i in range(decode)))


def planner(**kw) -> Planner:
    return Planner(PlannerSettings(**{**SLO, "sustain": 2, "dwell_s": 60, "cooldown_s": 20, **kw}))


def test_within_target_it_holds_and_says_so():
    d = planner().decide(observe(0))
    assert (d.action, d.reason) == ("hold", "within_slo")
    assert d.pressure == {"prefill": 0.2, "decode": 0.2}


def test_a_sustained_ttft_miss_moves_the_least_busy_decode_worker_to_prefill():
    p = planner()
    first = p.decide(observe(0, ttft=1.5, busy={"d0": 5, "d1": 1}))
    assert (first.action, first.reason) == ("hold", "sustaining")
    d = p.decide(observe(5, ttft=1.5, busy={"d0": 5, "d1": 1}))
    assert (d.action, d.reason, d.source, d.target, d.addresses) == ("switch", "ttft", "decode", "prefill", ("d1",))
    assert "prefill at 1.5" in d.detail and "d1 decode -> prefill" in d.detail


def test_an_itl_miss_moves_a_prefill_worker_to_decode():
    p = planner()
    obs = observe(0, ttft=0.1, itl=0.08, prefill=2, decode=1)
    p.decide(obs)
    d = p.decide(observe(5, ttft=0.1, itl=0.08, prefill=2, decode=1))
    assert (d.action, d.reason, d.source, d.target) == ("switch", "itl", "prefill", "decode")


def test_a_full_decode_pool_is_decodes_pressure_and_a_ttft_miss_behind_it_too():
    p = planner()
    for now in (0, 5):
        d = p.decide(observe(now, ttft=3.0, prefill=2, decode=1, pool_use=0.95))
    assert (d.action, d.reason, d.target) == ("switch", "kv_pool", "decode")
    p = planner()
    for now in (0, 5):
        d = p.decide(observe(now, ttft=3.0, prefill=2, decode=1, decode_waiting=8))
    assert (d.action, d.reason, d.target) == ("switch", "decode_queue", "decode")  # prompts wait for decode


def test_decodes_queue_behind_a_prefill_backlog_is_not_decodes_want():
    """Decode workers hold a slot for every prompt they wait for: with prompts queued on prefill, decode's queue
    is theirs, and the TTFT miss stays prefill's."""
    p = planner(sustain=1)
    obs = Observation(0, 3.0, 0.01, (WorkerLoad("p0", waiting=40),),
                      (WorkerLoad("d0", waiting=30), WorkerLoad("d1", waiting=30)))
    d = p.decide(obs)
    assert (d.action, d.source, d.target) == ("switch", "decode", "prefill") and d.reason in ("ttft", "prefill_queue")


def test_no_flapping_a_pressure_around_the_threshold_switches_nothing():
    p = planner()
    decisions = [p.decide(observe(5 * i, ttft=1.1 if i % 2 else 0.9)) for i in range(20)]
    assert {d.action for d in decisions} == {"hold"}


def test_after_a_switch_the_other_side_is_not_given_the_worker_back_at_once():
    p = planner(dwell_s=60, cooldown_s=20)
    for now in (0, 5):
        d = p.decide(observe(now, ttft=1.5, prefill=1, decode=3))
    assert d.action == "switch" and d.addresses == ("d0",)
    # Now decode misses ITL: the cooldown holds first, then d0's dwell keeps it in prefill while p0 may go.
    held = [p.decide(observe(now, itl=0.1, prefill=2, decode=2)) for now in (10, 15)]
    assert [h.reason for h in held] == ["sustaining", "cooldown"]
    later = p.decide(observe(30, itl=0.1, prefill=2, decode=2))
    assert later.action == "switch" and later.source == "prefill"
    assert later.addresses == ("p0",)  # the least busy of the prefill workers, none of which changed role


def test_dwell_keeps_a_worker_that_just_changed_role_where_it_is():
    p = planner(dwell_s=100, cooldown_s=0, sustain=1)
    w = WorkerLoad
    assert p.decide(Observation(0, 1.1, 0.01, (w("p0"),), (w("d0"), w("d1"), w("d2")))).addresses == ("d0",)
    assert p.decide(Observation(1, 1.1, 0.01, (w("p0"), w("d0")), (w("d1"), w("d2")))).addresses == ("d1",)
    # Decode misses ITL now: d0 and d1 are idle but changed role a moment ago; p0, busy, is the one that goes.
    back = p.decide(Observation(2, 0.1, 0.2, (w("p0", running=9), w("d0"), w("d1")), (w("d2"),)))
    assert (back.action, back.addresses, back.target) == ("switch", ("p0",), "decode")
    held = p.decide(Observation(3, 0.1, 0.2, (w("d0"), w("d1")), (w("d2"), w("p0"))))
    assert (held.action, held.reason) == ("hold", "dwell")
    assert p.decide(Observation(101, 0.1, 0.2, (w("d0"), w("d1")), (w("d2"), w("p0")))).addresses == ("d0",)


def test_one_decision_moves_as_many_workers_as_the_needy_side_wants_and_the_other_can_spare():
    """TTFT at 3x its target on 2 prefill workers: 8 would bring it to 0.8, so 6 more; decode (16 workers, light)
    gives a quarter of itself at most in one decision, 4. Busier, it gives what keeps it within 0.8."""
    d = planner(sustain=1).decide(observe(0, ttft=3.0, prefill=2, decode=16))
    assert d.action == "switch" and d.addresses == ("d0", "d1", "d10", "d11")  # the least busy, by address
    assert "with 4 worker(s) less" in d.detail
    busy = {f"d{i}": 8 for i in range(16)}  # ITL at 0.7 with 8 each: k gone, 0.7 * (8 + 8 * 16 / (16 - k)) / 16
    d = planner(sustain=1).decide(observe(0, ttft=3.0, itl=0.035, prefill=2, decode=16, busy=busy))
    assert len(d.addresses) == 3  # k = 3: 0.78, k = 4: 0.82


def test_the_floor_one_worker_per_role_is_never_given_away():
    p = planner(sustain=1)
    d = p.decide(observe(0, ttft=5.0, prefill=1, decode=1))
    assert (d.action, d.reason) == ("hold", "floor")
    assert "more workers are needed" in d.detail
    assert p.desired == {"prefill": 7, "decode": 1}  # 1 worker at 5.0 -> ceil(5 / 0.8)
    p = planner(sustain=1, min_per_role=2)
    assert p.decide(observe(0, ttft=5.0, prefill=1, decode=2)).reason == "floor"


def test_a_busy_giver_keeps_its_worker():
    p = planner(sustain=1)
    busy = {"d0": 24, "d1": 24}  # ITL at half its target with 24 requests each: 48 on one -> 0.5 * 56 / 32
    d = p.decide(observe(0, ttft=2.0, itl=0.025, decode=2, busy=busy))
    assert (d.action, d.reason) == ("hold", "other_side_busy") and "would be at 0.88" in d.detail
    assert p.desired == {"prefill": 3, "decode": 2}


def test_a_step_bound_by_its_fixed_cost_gives_a_decode_worker_away():
    """ITL at 60 % of its target with one request per decode worker: a step's fixed cost, which one worker less
    hardly changes (0.6 * (8 + 2) / (8 + 1) = 0.67 <= 0.8)."""
    d = planner(sustain=1).decide(observe(0, ttft=2.0, itl=0.03, decode=2, busy={"d0": 1, "d1": 1}))
    assert (d.action, d.source, d.target) == ("switch", "decode", "prefill") and "predicted at 0.67" in d.detail


def test_no_traffic_is_within_target():
    d = planner().decide(observe(0, ttft=None, itl=None))
    assert d.reason == "within_slo" and d.pressure == {"prefill": 0.0, "decode": 0.111}


@pytest.mark.parametrize("bad, words", [
    (dict(ttft_slo_s=0), "the TTFT SLO must be > 0"),
    (dict(low=1.2), "0 < low < high"),
    (dict(min_per_role=0), "min_per_role must be >= 1"),
])
def test_bad_settings_are_refused_with_the_reason(bad, words):
    with pytest.raises(ValueError, match=words):
        PlannerSettings(**{**SLO, **bad})


# ---------------------------------------------------------------- the gateway's loop around the policy
def pd_pool(prefill: int, decode: int):
    from pdserve.proto import worker_pb2 as pb
    from pdserve.services.gateway.workers.pool import Worker, WorkerPool

    specs = {"prefill": [f"10.0.0.1:{5000 + i}" for i in range(prefill)],
             "decode": [f"10.0.0.2:{5000 + i}" for i in range(decode)]}
    pool = WorkerPool(specs)
    for role, addresses in specs.items():
        for address in addresses:
            pool.workers[address] = Worker(address, role, None, None, healthy=True, info=pb.InfoReply(),
                                           load=pb.LoadReply(free_pages=90, total_pages=100))
    return pool


def samples(metrics, name: str) -> dict:
    """{sorted labels: value} of a counter's samples."""
    return {tuple(sorted(sample.labels.items())): sample.value for family in metrics.registry.collect()
            if family.name == name for sample in family.samples if sample.name.endswith("_total")}


async def test_the_loop_switches_through_the_role_switch_and_counts_it():
    from pdserve.services.gateway.metrics import GatewayMetrics
    from pdserve.services.gateway.workers.planning import PlannerLoop
    from pdserve.services.gateway.workers.role_switch import SwitchRefused

    calls, metrics, pool = [], GatewayMetrics(), pd_pool(1, 2)
    answers = [SwitchRefused(503, "worker_lost", "Worker died during the switch."), 1.5]

    async def switch(pool, address, role):
        calls.append((address, role))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        pool.workers[address].role = role
        return answer

    loop = PlannerLoop(PlannerSettings(**SLO, sustain=1, cooldown_s=0, dwell_s=0), pool, metrics, switch)
    metrics.recent.ttft.append((time.perf_counter(), 2.0))  # twice the TTFT target
    first = await loop.tick()
    assert first.action == "switch" and loop.decisions[-1]["outcome"].startswith("failed: Worker died")
    assert samples(metrics, "pdserve_planner_role_switches") == {}
    await loop.tick()
    assert loop.decisions[-1]["outcome"] == "switched in 1.5 s" and len(calls) == 2
    assert samples(metrics, "pdserve_planner_role_switches") == {
        (("from", "decode"), ("reason", "ttft"), ("to", "prefill")): 1.0}
    held = await loop.tick()  # one decode worker left: the floor
    assert held.reason == "floor" and len(calls) == 2
    assert loop.describe()["decisions"][0]["reason"] == "floor"


async def test_dry_run_asks_the_switch_nothing_and_says_what_it_would_answer():
    from pdserve.services.gateway.metrics import GatewayMetrics
    from pdserve.services.gateway.workers.planning import PlannerLoop

    async def switch(*_):
        raise AssertionError("a dry run switched")

    metrics, pool = GatewayMetrics(), pd_pool(1, 2)
    loop = PlannerLoop(PlannerSettings(**SLO, sustain=1, dry_run=True), pool, metrics, switch)
    metrics.recent.ttft.append((time.perf_counter(), 2.0))
    d = await loop.tick()
    assert d.action == "switch" and loop.decisions[-1]["outcome"] == "dry run: not switched"
    assert samples(metrics, "pdserve_planner_dry_run_switches") == {
        (("from", "decode"), ("reason", "ttft"), ("to", "prefill")): 1.0}
    assert {w.role for w in pool.workers.values()} == {"prefill", "decode"}


def test_the_loop_refuses_a_colocated_deployment():
    from pdserve.services.gateway.metrics import GatewayMetrics
    from pdserve.services.gateway.workers.planning import PlannerLoop
    from pdserve.services.gateway.workers.pool import WorkerPool

    with pytest.raises(ValueError, match="give --prefill and --decode workers"):
        PlannerLoop(PlannerSettings(**SLO), WorkerPool({"colocated": ["10.0.0.1:1"]}), GatewayMetrics())
