"""`pdserve plan`: the split of W workers between prefill and decode (or all colocated) with the best goodput on a
trace, found by simulating each candidate (simulator.py) with the same settings and SLOs.

Every split is simulated when there are few enough (`EXHAUSTIVE`); otherwise evenly spaced ones, then every split
between the best one's neighbours. Ranked by goodput, then by TTFT p99. What limits a split is read from where its
requests miss the SLOs and which role is busiest: prefill-bound (TTFT missed, prefill workers busy), decode-bound
(ITL missed, or TTFT missed while decode workers are the busy ones: prompts wait for decode's pages and slots), or
the offered load (nearly every request within both SLOs).
"""
from __future__ import annotations

from pdserve.planning.costs import Costs
from pdserve.planning.metrics import summarize
from pdserve.planning.simulator import Deployment, simulate
from pdserve.planning.traces import TraceRequest

EXHAUSTIVE = 16  # up to this many splits are all simulated
SAMPLES = 8


def candidates(workers: int) -> list[tuple[int, int, int]]:
    """(prefill, decode, colocated) of every static split of `workers`."""
    return [(0, 0, workers)] + [(p, workers - p, 0) for p in range(1, workers)]


def limit_of(summary: dict) -> str:
    busy = summary["utilisation"]
    shares = ", ".join(f"{role} busy {share:.0%}" for role, share in busy.items())
    ttft_miss, itl_miss = 1 - summary["ttft_met"], 1 - summary["itl_met"]
    if ttft_miss <= 0.01 and itl_miss <= 0.01:
        return f"the offered load: {summary['slo_attainment']:.0%} of requests within both SLOs ({shares})"
    if "colocated" in busy:
        what = "prompts wait" if ttft_miss >= itl_miss else "prefill steps stall decoding"
        return (f"compute: {ttft_miss:.0%} miss the TTFT SLO, {itl_miss:.0%} the ITL SLO; {what} ({shares})")
    if itl_miss > ttft_miss or busy.get("decode", 0) > busy.get("prefill", 0):
        return f"decode: {itl_miss:.0%} miss the ITL SLO, {ttft_miss:.0%} the TTFT SLO ({shares})"
    return f"prefill: {ttft_miss:.0%} miss the TTFT SLO, {itl_miss:.0%} the ITL SLO ({shares})"


def plan(costs: Costs, trace: list[TraceRequest], workers: int, settings: dict, ttft_slo_s: float,
         itl_slo_s: float) -> dict:
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    splits = candidates(workers)
    results: dict[tuple[int, int, int], dict] = {}

    def run(split: tuple[int, int, int]) -> None:
        if split not in results:
            p, d, c = split
            summary = summarize(simulate(Deployment(prefill=p, decode=d, colocated=c, **settings), costs, trace),
                                ttft_slo_s, itl_slo_s)
            summary["limit"] = limit_of(summary)
            results[split] = summary

    if len(splits) <= EXHAUSTIVE:
        for split in splits:
            run(split)
    else:
        step = max(1, (workers - 1) // SAMPLES)
        for split in [splits[0]] + splits[1::step] + [splits[-1]]:
            run(split)
        best = max((s for s in results if s[2] == 0), key=lambda s: rank(results[s]))[0]
        for p in range(max(1, best - step), min(workers - 1, best + step) + 1):
            run((p, workers - p, 0))
    ranked = sorted(results.values(), key=rank, reverse=True)
    return {"workers": workers, "ttft_slo_s": ttft_slo_s, "itl_slo_s": itl_slo_s,
            "best": ranked[0], "runner_up": ranked[1] if len(ranked) > 1 else None, "all": ranked}


def rank(summary: dict) -> tuple[float, float]:
    """Requests within the SLOs (the same trace for every split: a count, where goodput's rate would also weigh
    when each run's last request ends), then TTFT p99."""
    return round(summary["slo_attainment"], 9), -summary["ttft_p99_s"]


def describe(result: dict) -> str:
    lines = [f"{'split':<14} {'goodput/s':>9} {'within SLO':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
             f"{'tok/s':>8}"]
    for s in result["all"]:
        lines.append(f"{s['deployment']:<14} {s['goodput_rps']:>9.2f} {s['slo_attainment']:>10.0%} "
                     f"{s['ttft_p50_s'] * 1e3:>7.0f}ms {s['ttft_p99_s'] * 1e3:>7.0f}ms {s['itl_p50_s'] * 1e3:>6.1f}ms "
                     f"{s['output_tok_s']:>8.1f}")
    best, second = result["best"], result["runner_up"]
    lines.append(f"best: {best['deployment']} ({best['goodput_rps']:.2f} good req/s); limited by {best['limit']}")
    if second is not None:
        lines.append(f"runner-up: {second['deployment']} ({second['goodput_rps']:.2f} good req/s); limited by "
                     f"{second['limit']}")
    return "\n".join(lines)
