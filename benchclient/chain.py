"""`pdserve bench --api responses --chain TURNS`: chained conversations over /v1/responses, each turn's TTFT
against the first's.

`conversations` conversations run at once; each sends TURNS streamed requests in a row, every one continuing
the last with `previous_response_id` (the server stores each response). Turn k's prompt holds every earlier
turn, so without a prefix cache its time to first token grows with k; with one (and routing that sends the
chain back to the worker holding it), only the new input is computed and later turns stay near the first.
The report, per turn: TTFT p50 and p90, the p50 against the first turn's, and the prompt and cached tokens
the server counted (p50).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from pdserve.benchclient.load import ERROR_TEXT_LIMIT, Load, Target, make_prompts
from pdserve.benchclient.report import percentile, redact
from pdserve.benchclient.responses import CONTENT_EVENTS, FINISH_EVENTS, responses_body


@dataclass
class TurnResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    response_id: str | None = None
    input_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class TurnSummary:
    turn: int  # 1-based
    completed: int
    failed: int
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    ttft_vs_first: float | None  # this turn's TTFT p50 / the first turn's
    input_tokens_p50: float | None
    cached_tokens_p50: float | None


async def stream_turn(session: aiohttp.ClientSession, target: Target, load: Load, prompt: str,
                      previous: str | None) -> TurnResult:
    """One streamed turn: its TTFT, its response id and the usage the server reported. Never raises (but for
    cancellation)."""
    body = responses_body(target.model, prompt, load.output_len, load.temperature, dict(load.extra_body), previous)
    timeout = aiohttp.ClientTimeout(total=load.timeout_s, sock_read=load.stall_timeout_s)
    started = time.perf_counter()
    result = TurnResult(False)
    try:
        async with session.post(f"{target.base_url}/responses", json=body, headers=target.headers(),
                                timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:ERROR_TEXT_LIMIT]
                return TurnResult(False, f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                kind = event.get("type")
                if kind == "response.created":
                    result.response_id = event["response"]["id"]
                elif kind in CONTENT_EVENTS and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - started
                elif kind in FINISH_EVENTS:
                    usage = event["response"].get("usage") or {}
                    result.input_tokens = usage.get("input_tokens", 0)
                    result.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
                    result.ok = result.ttft_s is not None and result.response_id is not None
                elif kind in ("response.failed", "error"):
                    error = event.get("response", {}).get("error") or event
                    return TurnResult(False, f"error event: {json.dumps(error)[:ERROR_TEXT_LIMIT]}")
        return result if result.ok else TurnResult(False, "the stream ended before response.completed")
    except asyncio.TimeoutError:
        return TurnResult(False, "timed out")
    except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
        return TurnResult(False, f"{type(exc).__name__}: {exc}")


async def run_chain(target: Target, load: Load, conversations: int, turns: int, warmup: int = 0,
                    on_error: Callable[[str], None] | None = None) -> list[TurnSummary]:
    """Every conversation's turns, in order; one summary per turn. A failed turn ends its conversation."""
    prompts = make_prompts(conversations * turns + warmup, load.prompt_len, load.seed)
    by_turn: list[list[TurnResult]] = [[] for _ in range(turns)]
    async with aiohttp.ClientSession() as session:
        for i in range(warmup):
            await stream_turn(session, target, load, prompts[-1 - i], None)

        async def conversation(c: int) -> None:
            previous = None
            for t in range(turns):
                result = await stream_turn(session, target, load, prompts[c * turns + t], previous)
                by_turn[t].append(result)
                if not result.ok:
                    if on_error:
                        on_error(redact(result.error or "failed", target.api_key))
                    return
                previous = result.response_id

        await asyncio.gather(*(conversation(c) for c in range(conversations)))
    summaries: list[TurnSummary] = []
    for t, results in enumerate(by_turn):
        ok = [r for r in results if r.ok]
        p50 = percentile([r.ttft_s * 1000 for r in ok], 50)
        first = summaries[0].ttft_ms_p50 if summaries else p50
        summaries.append(TurnSummary(
            t + 1, len(ok), len(results) - len(ok), p50, percentile([r.ttft_s * 1000 for r in ok], 90),
            p50 / first if p50 is not None and first else None, percentile([r.input_tokens for r in ok], 50),
            percentile([r.cached_tokens for r in ok], 50)))
    return summaries


def format_chain(summaries: list[TurnSummary]) -> str:
    def cell(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{'turn':>4} {'ok':>4} {'failed':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'vs turn 1':>9} "
             f"{'prompt tok':>10} {'cached tok':>10}"]
    for s in summaries:
        lines.append(f"{s.turn:>4} {s.completed:>4} {s.failed:>6} {cell(s.ttft_ms_p50, '9.1f')} "
                     f"{cell(s.ttft_ms_p90, '9.1f')} {cell(s.ttft_vs_first, '8.2f')}x "
                     f"{cell(s.input_tokens_p50, '10.0f')} {cell(s.cached_tokens_p50, '10.0f')}")
    return "\n".join(lines)
