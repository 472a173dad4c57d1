"""The simulator on made-up step costs: the figures follow from the costs and the project's own scheduling, a run of
decode steps simulated as one gives exactly what step-by-step simulation gives, shared prefixes are served from the
prefix cache, pages all come back, and the planner ranks splits by goodput."""
from __future__ import annotations

import pytest

import pdserve.planning.sim_worker as sim_worker
from pdserve.planning.costs import costs_of, fit_nonnegative
from pdserve.planning.metrics import summarize
from pdserve.planning.plan import plan
from pdserve.planning.simulator import Deployment, Simulation, simulate
from pdserve.planning.traces import TraceRequest, synthetic

PREFILL_PER_TOKEN = 1e-4
DECODE_STEP = 0.010


def profile(decode_per_req: float = 1e-3) -> dict:
    return {"version": 1, "page_size": 16, "kv_bytes_per_token": 1000, "max_total_tokens": 32768,
            "prefill": [{"tokens": n, "cached": c, "seconds": 0.002 + (n - c) * PREFILL_PER_TOKEN}
                        for n, c in ((64, 0), (256, 0), (256, 128), (1024, 0))],
            "decode": [{"batch": b, "context": ctx, "seconds": DECODE_STEP + decode_per_req * b}
                       for b in (1, 8, 32) for ctx in (64, 512)],
            "transfer": [{"bytes": n, "seconds": 1e-3 + n / 1e9} for n in (1e5, 1e7)],
            "overheads": {"gateway_request_s": 1e-3, "gateway_token_s": 1e-5}}


def test_the_fit_recovers_the_costs_and_never_goes_negative():
    costs = costs_of(profile())
    assert costs.prefill_s([(500, 0)]) == pytest.approx(0.002 + 500 * PREFILL_PER_TOKEN, rel=1e-6)
    assert costs.decode_s(4, 4 * 300) == pytest.approx(DECODE_STEP + 4e-3, rel=1e-6)
    assert fit_nonnegative([[1, 1], [1, 2], [1, 3]], [3.0, 2.0, 1.0]) == [pytest.approx(2.0), 0.0]


def test_one_request_alone_takes_what_its_steps_cost():
    costs = costs_of(profile())
    result = simulate(Deployment(colocated=1), costs, [TraceRequest(0.0, 500, 11)])
    s = summarize(result, 1.0, 0.1)
    prefill = 0.002 + 500 * PREFILL_PER_TOKEN
    assert s["ttft_p50_s"] == pytest.approx(1e-3 + prefill + 1e-5, rel=1e-6)
    assert s["itl_p50_s"] == pytest.approx(DECODE_STEP + 1e-3, rel=1e-6)
    assert s["e2e_p50_s"] == pytest.approx(s["ttft_p50_s"] + 10 * s["itl_p50_s"], rel=1e-6)
    assert result.requests[0].output_len == 11 and s["completed"] == 1


def test_pd_adds_the_kv_transfer_to_the_first_token():
    costs = costs_of(profile())
    one = [TraceRequest(0.0, 500, 4)]
    pd = summarize(simulate(Deployment(prefill=1, decode=1), costs, one), 1.0, 0.1)
    colocated = summarize(simulate(Deployment(colocated=1), costs, one), 1.0, 0.1)
    assert pd["ttft_p50_s"] - colocated["ttft_p50_s"] == pytest.approx(costs.transfer_s(500), rel=1e-6)


@pytest.mark.parametrize("deployment", [Deployment(colocated=2), Deployment(prefill=1, decode=2),
                                        Deployment(prefill=2, decode=1, page_size=4, max_total_tokens=6000,
                                                   max_running_requests=8, chunked_prefill_size=128)])
def test_runs_of_decode_steps_match_step_by_step(monkeypatch, deployment):
    trace = synthetic(rate=6, duration_s=20, input_median=200, output_median=40, seed=5)
    costs = costs_of(profile())
    fast = Simulation(deployment, costs)
    fast_result = fast.run(trace)
    monkeypatch.setattr(sim_worker, "LONGEST_RUN", 1)
    slow = simulate(deployment, costs, trace)
    assert [(r.first, r.last) for r in fast_result.requests] == [(r.first, r.last) for r in slow.requests]
    assert sorted(fast_result.itls) == pytest.approx(sorted(slow.itls))
    for worker in fast.workers:  # every page is back: free or cached, none held
        report = worker.scheduler.check_integrity()
        assert report.ok and report.held == 0, report.message
    assert all(r.first >= r.arrival for r in fast_result.requests)


def test_a_tight_pool_retracts_and_still_finishes_everything():
    trace = [TraceRequest(0.01 * i, 300, 200) for i in range(12)]
    result = simulate(Deployment(colocated=1, max_total_tokens=2048, page_size=16), costs_of(profile()), trace)
    assert all(r.first > 0 and r.last >= r.first for r in result.requests)


def test_shared_hash_ids_are_served_from_the_prefix_cache():
    shared = [TraceRequest(i * 2.0, 1100, 3, (7, 8)) for i in range(3)]
    alone = [TraceRequest(i * 2.0, 1100, 3, (10 + 2 * i, 11 + 2 * i)) for i in range(3)]
    costs = costs_of(profile())
    hit = simulate(Deployment(prefill=1, decode=1), costs, shared)
    miss = simulate(Deployment(prefill=1, decode=1), costs, alone)
    assert [r.cached_tokens for r in hit.requests] == [0, 1024, 1024]
    assert [r.cached_tokens for r in miss.requests] == [0, 0, 0]
    assert summarize(hit, 1, 1)["ttft_p50_s"] < summarize(miss, 1, 1)["ttft_p50_s"]


def test_bad_deployments_are_refused():
    with pytest.raises(ValueError, match="not both"):
        Deployment(prefill=1, decode=1, colocated=1)
    with pytest.raises(ValueError, match="both --prefill N and --decode M"):
        Deployment(prefill=2)


def test_plan_prefers_more_decode_workers_when_decode_is_the_bottleneck():
    # Decode steps grow fast with the batch; prompts are cheap: the best split leans to decode.
    costs = costs_of(profile(decode_per_req=0.02))
    trace = synthetic(rate=3, duration_s=30, input_median=100, output_median=60, seed=2)
    result = plan(costs, trace, 4, {}, ttft_slo_s=2.0, itl_slo_s=0.06)
    assert len(result["all"]) == 4  # colocated 4, PD 1:3, 2:2, 3:1
    within = [s["slo_attainment"] for s in result["all"]]  # the same trace for each: a count of good requests
    assert within == sorted(within, reverse=True) and within[0] > within[-1]
    assert result["best"]["deployment"] in ("PD 1:3", "colocated 4")
    worst_pd = min((s for s in result["all"] if s["deployment"].startswith("PD")), key=lambda s: s["goodput_rps"])
    assert worst_pd["deployment"] == "PD 3:1" and worst_pd["limit"].startswith("decode")


def test_the_planner_follows_a_two_phase_load_with_one_switch_per_phase_change():
    """Long prompts, then long answers, then long prompts: PD 1:2 misses TTFT in the prompt phases, PD 2:1 ITL
    in the answer phase; the gateway's planner, run on the simulated clock, moves one worker at each phase change
    (each switch after the change, none twice for one change), serves every request, and beats both splits."""
    from pdserve.planning.traces import two_phase
    from pdserve.services.gateway.planner import PlannerSettings

    costs, slo = costs_of(profile()), (0.5, 0.03)
    trace = two_phase((8, 3), 60)
    planner = PlannerSettings(*slo, interval_s=2, window_s=10, dwell_s=20)
    results = {d.label: simulate(d, costs, trace) for d in (Deployment(prefill=1, decode=2),
                                                             Deployment(prefill=2, decode=1),
                                                             Deployment(prefill=1, decode=2, planner=planner))}
    planned = results["PD 1:2 + planner"]
    moves = [(s.source, s.target) for s in planned.switches]
    assert moves == [("decode", "prefill"), ("prefill", "decode"), ("decode", "prefill")]
    starts = [s.at for s in planned.switches]
    assert starts[0] < 60 < starts[1] < 120 < starts[2] and all(s.done > s.at for s in planned.switches)
    goodput = {label: summarize(r, *slo)["goodput_rps"] for label, r in results.items()}
    assert summarize(planned, *slo)["completed"] == len(trace)
    assert goodput["PD 1:2 + planner"] > 1.05 * max(goodput["PD 1:2"], goodput["PD 2:1"]), goodput
    assert results["PD 1:2"].switches == [] and "switches" in summarize(planned, *slo)


def test_a_planner_on_colocated_workers_is_refused():
    from pdserve.services.gateway.planner import PlannerSettings

    with pytest.raises(ValueError, match="between prefill and decode"):
        Deployment(colocated=2, planner=PlannerSettings(1.0, 0.1))
