"""`pdserve profile`, `pdserve simulate` and `pdserve plan`: measure this machine, replay a trace on a simulated
deployment, and pick the split of a number of workers with the best goodput.

Errors a user can cause (a missing or malformed trace or profile, impossible worker counts) end with one line on
stderr and exit status 2; nothing here loads a model but `profile`.
"""
from __future__ import annotations

import argparse
import json
import sys

from pdserve.planning.traces import FORMATS


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "profile":
        from pdserve.planning.profile import add_profile_arguments

        add_profile_arguments(parser)
        return
    parser.add_argument("--profile", required=True, metavar="FILE", help="a profile written by `pdserve profile`")
    parser.add_argument("--trace", required=True, metavar="FILE",
                        help="a trace: Azure LLM inference CSV, Mooncake JSONL or BurstGPT CSV")
    parser.add_argument("--trace-format", choices=FORMATS, default=None,
                        help="the trace's format (default: told from its extension and header)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply every arrival time by this (0.5: the trace at twice its rate)")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="time to first token a request must meet")
    parser.add_argument("--itl-slo-ms", type=float, default=100.0,
                        help="mean inter-token latency (after the first token) a request must meet")
    if command == "simulate":
        parser.add_argument("--prefill", type=int, default=0, metavar="N", help="prefill workers (PD)")
        parser.add_argument("--decode", type=int, default=0, metavar="M", help="decode workers (PD)")
        parser.add_argument("--colocated", type=int, default=0, metavar="K", help="colocated workers (instead of PD)")
        parser.add_argument("--planner", default="off", choices=["off", "slo"],
                            help="slo: the gateway's SLO planner moves workers between prefill and decode during the "
                                 "run (the targets: --ttft-slo-ms, --itl-slo-ms)")
        parser.add_argument("--planner-interval-s", type=float, default=5.0, help="seconds between two decisions")
        parser.add_argument("--planner-window-s", type=float, default=30.0,
                            help="seconds of TTFT and ITL a decision reads, and the pause after a switch")
        parser.add_argument("--planner-dwell-s", type=float, default=60.0,
                            help="a worker keeps a role the planner gave it at least this long")
        parser.add_argument("--plot", metavar="FILE", default=None,
                            help="also draw latency over the run (each request's TTFT and mean ITL at its arrival, "
                                 "the planner's switches) into FILE (PNG; needs matplotlib)")
        parser.add_argument("--switch-s", type=float, default=1.0,
                            help="what a role switch costs once the worker has finished its requests (seconds)")
    else:
        parser.add_argument("--workers", type=int, required=True, metavar="W",
                            help="workers to split between prefill and decode (colocated W is compared too)")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default: the profile's)")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool capacity of each worker in tokens (default: the profile's)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument("--chunked-prefill-size", type=int, default=2048, help="<= 0 disables chunking")
    parser.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    parser.add_argument("--enable-mixed-chunk", action="store_true",
                        help="colocated: prefill steps also decode the running requests")
    parser.add_argument("--routing-policy", default="cache_aware", choices=["cache_aware", "round_robin"])
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE as JSON")


def main(args: argparse.Namespace, command: str) -> int:
    if command == "profile":
        from pdserve.planning.profile import run_profile

        return run_profile(args)
    from pdserve.planning.costs import ProfileError, costs_of, load_profile
    from pdserve.planning.traces import TraceError, read_trace

    try:
        if args.time_scale <= 0:
            raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
        costs = costs_of(load_profile(args.profile))
        trace = read_trace(args.trace, args.trace_format, args.time_scale)
        settings = dict(page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                        max_running_requests=args.max_running_requests, max_prefill_tokens=args.max_prefill_tokens,
                        chunked_prefill_size=args.chunked_prefill_size, schedule_policy=args.schedule_policy,
                        mixed_prefill=args.enable_mixed_chunk, routing_policy=args.routing_policy)
        slo = (args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
        if command == "simulate":
            out = _simulate(args, costs, trace, settings, slo)
        else:
            out = _plan(args, costs, trace, settings, slo)
    except (ProfileError, TraceError, ValueError) as exc:
        print(f"pdserve {command}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _simulate(args, costs, trace, settings: dict, slo: tuple[float, float]) -> dict:
    import time

    from pdserve.planning.metrics import report, summarize
    from pdserve.planning.simulator import Deployment, simulate

    planner = None
    if args.planner == "slo":
        from pdserve.services.gateway.planner import PlannerSettings

        planner = PlannerSettings(slo[0], slo[1], window_s=args.planner_window_s, interval_s=args.planner_interval_s,
                                  dwell_s=args.planner_dwell_s)
    if args.switch_s < 0:
        raise ValueError(f"--switch-s must be >= 0, got {args.switch_s}")
    deployment = Deployment(prefill=args.prefill, decode=args.decode, colocated=args.colocated, planner=planner,
                            switch_s=args.switch_s, **settings)
    started = time.perf_counter()
    result = simulate(deployment, costs, trace.requests)
    summary = summarize(result, *slo)
    summary["trace"] = trace.source
    summary["wall_s"] = time.perf_counter() - started
    print(f"trace {trace.source} ({trace.format}): {len(trace)} requests over {trace.duration_s:.1f} s")
    print(report(summary))
    for switch in summary.get("switches", []):
        print(f"  switch at {switch['at_s']:.1f} s: {switch['address']} {switch['from']} -> {switch['to']} "
              f"({switch['reason']})")
    if args.plot:
        from pdserve.planning.plot import plot

        print(f"plot: {plot(result, args.plot, *slo)}")
    return summary


def _plan(args, costs, trace, settings: dict, slo: tuple[float, float]) -> dict:
    from pdserve.planning.plan import describe, plan

    result = plan(costs, trace.requests, args.workers, settings, *slo)
    print(f"trace {trace.source} ({trace.format}): {len(trace)} requests over {trace.duration_s:.1f} s; "
          f"{args.workers} workers")
    print(describe(result))
    return result
