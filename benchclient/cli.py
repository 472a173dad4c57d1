"""`pdserve bench`: streaming chat load against any OpenAI-compatible server, and its latency statistics.

    pdserve bench --base-url http://127.0.0.1:30000/v1 --concurrency 1,8,32 [--output-len 128]
                  [--prompt-len 40] [--num-requests N] [--request-rate R] [--warmup 2] [--json FILE]

A run: resolve the model (`GET /models`, its first id, unless `--model`) -> warm-up requests (not measured)
-> for each concurrency level, `num_requests` streamed chat completions with at most `concurrency` in flight
(closed loop; with `--request-rate`, requests also arrive as a Poisson process) -> one `RequestResult` per
request -> one `LevelSummary` per level -> a table, and JSON if asked. `--api` picks what the requests speak
(chat completions, Anthropic's messages, OpenAI's responses); `--api responses --chain TURNS` runs chained
conversations instead of the sweep and reports each turn's TTFT against the first's (chain.py).

The load and its timing live in `load.py` (how tokens and inter-token latencies are counted), the statistics
and the table in `report.py`, the plot in `plot.py`; this module is the command: its flags and its run.

Failures never stop a run: a request that fails (HTTP error, error event, timeout, broken stream) is counted,
and each distinct error is printed once. The API key is sent, never printed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

import aiohttp

from pdserve.benchclient.chain import format_chain, run_chain
from pdserve.benchclient.load import APIS, ErrorReporter, Load, Target, fetch_model, run_sweep
from pdserve.benchclient.plot import plot
from pdserve.benchclient.report import LevelSummary, RequestResult, format_errors, format_table, redact


def parse_concurrencies(values: Sequence[str]) -> list[int]:
    levels: list[int] = []
    for value in values:
        for part in value.split(","):
            if part.strip():
                level = int(part)
                if level < 1:
                    raise ValueError(f"--concurrency must be at least 1, got {level}")
                levels.append(level)
    return levels or [1]


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1",
                        help="OpenAI base URL of the server (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model to request (default: the first of GET /models)")
    parser.add_argument("--models", default=None, metavar="NAME[,NAME...]",
                        help="spread the requests over these models in turn, e.g. LoRA adapters (overrides --model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                        help="bearer key for the server (default: $OPENAI_API_KEY); never printed")
    parser.add_argument("--concurrency", action="append", default=[], metavar="N[,N...]",
                        help="requests in flight; repeat or list several for a sweep (default: 1)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests per concurrency level (default: 4 x concurrency; at least concurrency)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens each request generates (max_tokens with ignore_eos)")
    parser.add_argument("--prompt-len", type=int, default=40, help="approximate prompt tokens (distinct prompts)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: greedy)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default: inf, a closed loop at the concurrency)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a whole request may take")
    parser.add_argument("--stall-timeout", type=float, default=120.0,
                        help="seconds a stream may stay silent before the request counts as failed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="also draw throughput against TTFT and ITL, a point per level (needs matplotlib)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar per level on stderr (default: when stderr is a terminal)")
    parser.add_argument("--api", choices=sorted(APIS), default="chat",
                        help="the API the requests speak: chat completions, Anthropic's messages or OpenAI's responses "
                             "(default: chat)")
    parser.add_argument("--chain", type=int, default=0, metavar="TURNS",
                        help="with --api responses: instead of the sweep, conversations of TURNS turns chained by "
                             "previous_response_id (as many at once as the first --concurrency), and each turn's "
                             "TTFT against the first's")
    parser.add_argument("--workload", choices=["chat", "copy"], default="chat",
                        help="chat: distinct prompts of seeded words; copy: a passage of prose and code with an "
                             "instruction to repeat it, where speculative decoding's drafts are right (default: chat)")
    parser.add_argument("--client-processes", type=int, default=1, metavar="N",
                        help="send each level from N client processes, each with 1/N of the streams: one Python "
                             "process reads some tens of thousands of events per second at most, and past that it "
                             "would be what the figures measure (default: 1; no progress bars with N > 1)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="instead of the sweep, replay this trace (Azure CSV, Mooncake JSONL, BurstGPT CSV) at its "
                             "arrival times, prompts and outputs of its exact token counts, through /completions")
    parser.add_argument("--trace-time-scale", type=float, default=1.0,
                        help="multiply the trace's arrival times by this (0.5: twice its rate)")
    parser.add_argument("--extra-body", default=None, metavar="JSON",
                        help='more fields for every request, e.g. \'{"response_format": {"type": "json_object"}}\'')


def load_from_args(args: argparse.Namespace) -> Load:
    if args.output_len < 1 or args.prompt_len < 1:
        raise ValueError("--output-len and --prompt-len must be at least 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be positive (inf for a closed loop)")
    if args.timeout <= 0 or args.stall_timeout <= 0:
        raise ValueError("--timeout and --stall-timeout must be positive")
    if args.client_processes < 1:
        raise ValueError("--client-processes must be at least 1")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as exc:
            raise ValueError(f"--extra-body is not valid JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    return Load(output_len=args.output_len, prompt_len=args.prompt_len, temperature=args.temperature,
                request_rate=args.request_rate, timeout_s=args.timeout, stall_timeout_s=args.stall_timeout,
                seed=args.seed, extra_body=tuple(extra.items()),
                models=tuple(m for m in (args.models or "").split(",") if m), api=args.api,
                workload=args.workload)


def report(target: Target, load: Load, summaries: Sequence[LevelSummary]) -> dict:
    """What --json writes: the settings and every level (no API key)."""
    settings = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(load).items()}
    return {"base_url": target.base_url, "model": target.model, "load": settings,
            "results": [asdict(s) for s in summaries]}


async def _bench(args: argparse.Namespace) -> int:
    load = load_from_args(args)
    concurrencies = parse_concurrencies(args.concurrency)
    base_url = args.base_url.rstrip("/")
    model = args.model
    if model is None:
        async with aiohttp.ClientSession() as session:
            model = await fetch_model(session, base_url, args.api_key)
    target = Target(base_url, model, args.api_key)
    if args.trace:
        return await _trace(args, target, load)
    rate = "closed loop" if math.isinf(load.request_rate) else f"{load.request_rate:g} req/s Poisson"
    print(f"[bench] {base_url} model {model}: {load.output_len} output tokens, ~{load.prompt_len}-token prompts, "
          f"{rate}, concurrency {','.join(map(str, concurrencies))}", flush=True)
    if args.chain:
        return await _chain(args, target, load, concurrencies[0])
    show = (sys.stderr.isatty() if args.progress is None else args.progress) and args.client_processes == 1
    bars = ProgressBars() if show else None
    summaries = await run_sweep(target, load, concurrencies, args.num_requests, args.warmup,
                                on_level=lambda s: (bars and bars.close()) or print(
                                    f"[bench] concurrency {s.concurrency}: {s.completed} ok, {s.failed} failed "
                                    f"in {s.duration_s:.1f} s", flush=True),
                                progress=bars.level if bars else None, processes=args.client_processes)
    print(format_table(summaries))
    print(f"(times in ms; ITL tokens counted from {', '.join(sorted({s.itl_tokens_from for s in summaries}))})")
    if errors := format_errors(summaries):
        print(errors)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report(target, load, summaries), f, indent=2)
    if args.plot:
        print(f"[bench] plot: {plot(summaries, args.plot, f'{model} at {base_url}')}")
    return 0 if all(s.completed for s in summaries) else 1


async def _chain(args: argparse.Namespace, target: Target, load: Load, conversations: int) -> int:
    if args.api != "responses" or args.chain < 2:
        raise ValueError("--chain needs --api responses and at least 2 turns")
    print(f"[bench] {conversations} conversations of {args.chain} chained turns", flush=True)
    turns = await run_chain(target, load, conversations, args.chain, args.warmup, ErrorReporter())
    print(format_chain(turns))
    print("(times in ms; prompt and cached tokens as the server counted them, p50)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report(target, load, []), "chain": [asdict(t) for t in turns]}, f, indent=2)
    return 0 if all(t.completed == conversations for t in turns) else 1


async def _trace(args: argparse.Namespace, target: Target, load: Load) -> int:
    from pdserve.benchclient.replay import replay
    from pdserve.planning.traces import read_trace

    trace = read_trace(args.trace, time_scale=args.trace_time_scale)
    print(f"[bench] {target.base_url} model {target.model}: trace {args.trace} ({trace.format}), {len(trace)} "
          f"requests over {trace.duration_s:.1f} s",
          flush=True)
    summary = await replay(target, load, trace.requests, ErrorReporter())
    print(format_table([summary], label_header="replay", labels=["trace"]))
    if errors := format_errors([summary]):
        print(errors)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report(target, load, [summary]), "trace": args.trace}, f, indent=2)
    return 0 if summary.completed == summary.requests else 1


class ProgressBars:
    """One tqdm bar per level on stderr: requests done, failures in its postfix."""

    def __init__(self) -> None:
        self._bar = None
        self._failed = 0

    def level(self, concurrency: int, requests: int) -> Callable[[RequestResult], None]:
        from tqdm import tqdm

        self.close()
        self._bar, self._failed = tqdm(total=requests, desc=f"concurrency {concurrency}", unit="req",
                                       file=sys.stderr, leave=False), 0
        return self._done

    def _done(self, result: RequestResult) -> None:
        self._failed += bool(result.error)
        self._bar.update(1)
        if result.error:
            self._bar.set_postfix(failed=self._failed)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def main(args: argparse.Namespace, command: str) -> int:
    try:
        return asyncio.run(_bench(args))
    except (ValueError, RuntimeError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        message = redact(str(exc) or type(exc).__name__, args.api_key)
        print(f"error: {message}", file=sys.stderr)
        return 1
