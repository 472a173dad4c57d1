"""What a simulated run comes to, in the figures `pdserve bench` prints for a real one.

TTFT is from a request's arrival to its first token leaving the gateway; ITL every gap between two tokens of one
request (pooled over all requests, as the bench client pools them); E2E arrival to last token. Rates are over the
run's span, first arrival to last token. A request meets the SLOs when its TTFT is within the TTFT SLO and its mean
ITL (time per output token after the first) within the ITL SLO; goodput is such requests per second.
"""
from __future__ import annotations

import numpy as np

from pdserve.planning.simulator import SimResult


def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(result: SimResult, ttft_slo_s: float, itl_slo_s: float) -> dict:
    reqs = [r for r in result.requests if r.first >= 0]
    ttft = np.array([r.first - r.arrival for r in reqs])
    e2e = np.array([r.last - r.arrival for r in reqs])
    tpot = np.array([(r.last - r.first) / (r.output_len - 1) if r.output_len > 1 else 0.0 for r in reqs])
    itl = np.array(result.itls)
    span = max(result.end - result.start, 1e-9)
    tokens = sum(r.output_len for r in reqs)
    ttft_ok, itl_ok = ttft <= ttft_slo_s, tpot <= itl_slo_s
    good = int((ttft_ok & itl_ok).sum()) if reqs else 0
    return {
        "deployment": result.deployment.label,
        "requests": len(result.requests),
        "completed": len(reqs),
        "duration_s": span,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "output_tok_s": tokens / span,
        "request_rps": len(reqs) / span,
        "goodput_rps": good / span,
        "slo_attainment": good / len(reqs) if reqs else 0.0,
        "ttft_met": float(ttft_ok.mean()) if reqs else 0.0,
        "itl_met": float(itl_ok.mean()) if reqs else 0.0,
        "ttft_slo_s": ttft_slo_s, "itl_slo_s": itl_slo_s,
        "cached_tokens_mean": sum(r.cached_tokens for r in reqs) / max(1, len(reqs)),
        "utilisation": result.utilisation,
        "steps": result.steps,
        "switches": [s.as_dict() for s in result.switches],
    }


def report(summary: dict) -> str:
    ms = 1e3
    u = ", ".join(f"{role} {share:.0%}" for role, share in summary["utilisation"].items())
    return (f"{summary['deployment']}: {summary['completed']}/{summary['requests']} requests in "
            f"{summary['duration_s']:.1f} s simulated ({summary['steps']} steps)\n"
            f"  TTFT p50 {summary['ttft_p50_s'] * ms:.1f} ms  p99 {summary['ttft_p99_s'] * ms:.1f} ms\n"
            f"  ITL  p50 {summary['itl_p50_s'] * ms:.1f} ms  p99 {summary['itl_p99_s'] * ms:.1f} ms\n"
            f"  E2E  p50 {summary['e2e_p50_s']:.2f} s  p99 {summary['e2e_p99_s']:.2f} s\n"
            f"  output {summary['output_tok_s']:.1f} tok/s, {summary['request_rps']:.2f} req/s; goodput "
            f"{summary['goodput_rps']:.2f} req/s ({summary['slo_attainment']:.0%} within TTFT "
            f"{summary['ttft_slo_s'] * ms:.0f} ms, ITL {summary['itl_slo_s'] * ms:.0f} ms)\n"
            f"  busy: {u}")
