"""The load of bench_kv_tiers.py, over HTTP only: deterministic text, greedy streamed chat completions timed to their
first content chunk, multi-turn conversations run a wave (one turn of every conversation) at a time, and the rows
of its table (`Check`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import zlib
from dataclasses import dataclass

import aiohttp

from pdserve.benchclient import StreamTally, Target, make_prompts, percentile

QUESTION_LEN = 24  # words of each new user message
GREEDY_PROMPTS = 3
GREEDY_TOKENS = 32


# ---------------------------------------------------------------- text and requests


def text(tag: str, index: int, length: int) -> str:
    """Deterministic words, about `length` tokens, distinct for every (tag, index)."""
    return make_prompts(1, length, zlib.crc32(f"{tag}/{index}".encode()))[0]


@dataclass
class Answer:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


async def chat(session: aiohttp.ClientSession, target: Target, messages: list[dict], max_tokens: int,
               ignore_eos: bool = True) -> Answer:
    """One greedy streamed chat completion: its TTFT, text and usage. Never raises (but for cancellation)."""
    body = {"model": target.model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    tally, parts, usage = StreamTally(time.perf_counter()), [], {}
    try:
        async with session.post(f"{target.base_url}/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=900, sock_read=300)) as resp:
            if resp.status != 200:
                return Answer(False, f"HTTP {resp.status}: {' '.join((await resp.text())[:300].split())}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("error"):
                    return Answer(False, f"error event: {json.dumps(event['error'])[:300]}")
                tally.add(event, time.perf_counter())
                usage = event.get("usage") or usage
                parts += [(c.get("delta") or {}).get("content") or "" for c in event.get("choices") or []]
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        return Answer(False, f"{type(exc).__name__}: {exc}")
    timed = tally.result(time.perf_counter())
    if not timed.ok:
        return Answer(False, timed.error)
    return Answer(True, None, timed.ttft_s, "".join(parts), usage.get("prompt_tokens", 0),
                  usage.get("completion_tokens", 0), (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))


def ttft_ms_p50(answers: list[Answer]) -> float | None:
    p50 = percentile([a.ttft_s for a in answers if a.ok and a.ttft_s is not None], 50)
    return None if p50 is None else p50 * 1e3


def ask_all(target: Target, prompts: list[str], max_tokens: int = GREEDY_TOKENS) -> list[Answer]:
    """One prompt at a time (a single user message), each on an otherwise idle server."""
    async def run() -> list[Answer]:
        async with aiohttp.ClientSession() as session:
            return [await chat(session, target, [{"role": "user", "content": p}], max_tokens, ignore_eos=False)
                    for p in prompts]
    return asyncio.run(run())


# ---------------------------------------------------------------- conversations


@dataclass
class Turn:
    conversation: int
    turn: int  # 1-based
    answer: Answer


class Conversations:
    """One server's conversations, run a turn of every conversation at a time (a wave): `concurrency` turns in flight,
    in conversation order, so a conversation's next turn comes after every other conversation's. A failed turn ends
    its conversation."""

    def __init__(self, args: argparse.Namespace, concurrency: int) -> None:
        self.args = args
        self.concurrency = concurrency
        self.history = [[{"role": "system", "content": "Read this document, then answer questions about it.\n\n"
                                                       f"{text('document', c, args.doc_len)}"}]
                        for c in range(args.conversations)]
        self.live = list(range(args.conversations))
        self.turns: list[Turn] = []
        self.duration_s = 0.0  # the waves' wall time, summed

    def wave(self, target: Target, turn: int) -> None:
        async def run() -> None:
            todo = iter(list(self.live))
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.concurrency)) as session:
                async def slot() -> None:
                    for c in todo:
                        question = f"Question {turn}: {text(f'question-{c}', turn, QUESTION_LEN)}?"
                        messages = self.history[c] + [{"role": "user", "content": question}]
                        answer = await chat(session, target, messages, self.args.output_len)
                        self.turns.append(Turn(c, turn, answer))
                        if answer.ok:
                            self.history[c] = messages + [{"role": "assistant", "content": answer.text}]
                        else:
                            self.live.remove(c)

                await asyncio.gather(*(slot() for _ in range(self.concurrency)))

        started = time.perf_counter()
        asyncio.run(run())
        self.duration_s += time.perf_counter() - started

    def ok(self, first: int = 1) -> list[Answer]:
        return [t.answer for t in self.turns if t.answer.ok and t.turn >= first]

    def later_ttft_ms(self) -> float | None:
        return ttft_ms_p50(self.ok(2))

    def output_tok_s(self) -> float:
        return sum(a.completion_tokens for a in self.ok()) / self.duration_s if self.duration_s else 0.0

    def cached_later(self) -> float | None:
        return percentile([a.cached_tokens for a in self.ok(2) if a.cached_tokens is not None], 50)

    def kv_tokens(self) -> int:
        """Each conversation's last sequence (prompt and answer), summed: the KV the conversations leave."""
        last = {t.conversation: t.answer for t in self.turns if t.answer.ok}
        return sum(a.prompt_tokens + a.completion_tokens for a in last.values())

    def errors(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for t in self.turns:
            if not t.answer.ok:
                found[t.answer.error or "?"] = found.get(t.answer.error or "?", 0) + 1
        return found


# ---------------------------------------------------------------- results


@dataclass
class Check:
    case: str
    what: str
    target: str  # e.g. "<= 0.35"
    figure: str
    met: bool | None  # None: nothing to judge


def ratio_check(case: str, what: str, mine: float | None, base: float | None, bound: float, higher: bool,
                unit: str) -> Check:
    sign = ">=" if higher else "<="
    if mine is None or not base:
        return Check(case, what, f"{sign} {bound:g}", "-", None)
    value = mine / base
    return Check(case, what, f"{sign} {bound:g}", f"{value:.2f} ({mine:.1f} / {base:.1f} {unit})",
                 value >= bound if higher else value <= bound)


def same_answers(case: str, what: str, mine: list[Answer], base: list[Answer]) -> Check:
    pairs = [(a, b) for a, b in zip(mine, base) if a.ok and b.ok]
    same = sum(a.text == b.text for a, b in pairs)
    failed = len(mine) - len(pairs)
    return Check(case, what, "all identical", f"{same}/{len(pairs)}" + (f" ({failed} failed)" if failed else ""),
                 same == len(pairs) == len(mine) if mine else None)


def greedy_prompts(length: int) -> list[str]:
    return [f"{text('greedy', i, length)}\n\nSum up the text above in one sentence." for i in range(GREEDY_PROMPTS)]
