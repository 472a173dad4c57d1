"""`pdserve bench` load: streamed chat completions sent at a concurrency, each timed from its SSE stream.

A sweep: warm-up requests (not measured) -> for each concurrency level, `requests_for` streamed chat
completions with at most `concurrency` in flight (closed loop; with a request rate, requests also arrive as a
Poisson process) -> one `RequestResult` per request -> one `LevelSummary` per level (`report.py`).

Each request asks for exactly `output_len` tokens (`max_tokens` with `ignore_eos`), greedy unless a
temperature is set. Prompts are distinct (seeded words), so a prefix cache cannot serve one from another.

Token counting: the total output of a request is the `usage.completion_tokens` of its final chunk
(`stream_options.include_usage`). Each content chunk after the first adds one inter-token latency sample:
the time since the previous content chunk divided by the tokens this chunk carries. Those tokens come from
the per-chunk usage the server sends under `stream_options.continuous_usage_stats` (cumulative
`completion_tokens`); a server that does not send it is counted as one token per content chunk, and the
summary's `itl_tokens_from` says which ("usage" or "chunks").

A request never raises: a failure (HTTP error, error event, timeout, broken stream) is its result.

`Load.api` picks what the requests speak, a key of `APIS`: chat completions (the default) or Anthropic's
messages (messages.py), whose stream events are read as the chat chunks above.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import aiohttp

from pdserve.benchclient.completions import completions_body
from pdserve.benchclient.messages import messages_body, messages_chunk
from pdserve.benchclient.responses import responses_body, responses_chunk
from pdserve.benchclient.report import LevelSummary, RequestResult, redact, summarize

# Short common words: each is about one token in the usual BPE vocabularies, so N words ~ N prompt tokens.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "team minute idea kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force education"
).split()

ERROR_TEXT_LIMIT = 300  # characters of a server's error body worth showing


@dataclass(frozen=True)
class Target:
    """Where the load goes."""
    base_url: str  # the OpenAI base URL, e.g. http://127.0.0.1:30000/v1
    model: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Load:
    """What each request asks for and how requests are paced."""
    output_len: int = 128
    prompt_len: int = 40  # approximate prompt tokens (before the chat template)
    temperature: float = 0.0
    request_rate: float = math.inf  # requests/s of Poisson arrivals; inf: closed loop at the concurrency
    timeout_s: float = 600.0  # a whole request, first byte to last
    stall_timeout_s: float = 120.0  # longest silence within a request's stream
    seed: int = 0
    extra_body: tuple[tuple[str, object], ...] = ()  # more request fields (e.g. response_format), as pairs
    models: tuple[str, ...] = ()  # if set: request i asks for models[i % len] (e.g. LoRA adapters), not the target's
    api: str = "chat"  # which API the requests speak: a key of APIS
    workload: str = "chat"  # "chat": prompts of seeded words; "copy": a passage and an instruction to copy it


# ---------------------------------------------------------------- prompts


def make_prompts(count: int, prompt_len: int, seed: int, workload: str = "chat") -> list[str]:
    """`count` distinct prompts of about `prompt_len` tokens; the same seed gives the same prompts.

    workload "copy": each prompt is an instruction to repeat, reformat or correct a passage (prose and code
    lines) of about prompt_len tokens, so the answer quotes the prompt, as answers that edit code, extract
    fields or cite their sources do."""
    rng = random.Random(seed)
    if workload == "copy":
        return [_copy_prompt(rng, prompt_len) for _ in range(count)]
    return [" ".join(rng.choice(WORDS) for _ in range(max(1, prompt_len))) for _ in range(count)]


COPY_TASKS = ("Repeat the following text exactly, word for word:",
              "Copy the following notes, keeping every line as it is:",
              "Write the following text out again in full, then stop:")


def _copy_prompt(rng: random.Random, prompt_len: int) -> str:
    lines, tokens = [], 0
    while tokens < prompt_len:
        if rng.random() < 0.3:
            a, b = rng.sample(WORDS, 2)
            line = f"def {a}_{b}({a}, {b}):\n    return {a} {rng.choice('+-*')} {b}"
        else:
            a, b, c = rng.sample(WORDS, 3)
            line = f"The {a} of the {b} met on day {rng.randint(2, 28)} to discuss the {c} and its {rng.choice(WORDS)}."
        lines.append(line)
        tokens += len(line.split()) + 4  # words, plus punctuation and numbers taking tokens of their own
    return f"{rng.choice(COPY_TASKS)}\n\n" + "\n".join(lines)


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request may be sent: all at once for an infinite rate,
    otherwise a Poisson process (exponential gaps)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


# ---------------------------------------------------------------- one request


class StreamTally:
    """Timing of one streamed chat completion, fed one parsed SSE event at a time."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.content_chunks = 0
        self.usage_tokens: int | None = None  # latest cumulative completion_tokens seen
        self.tokens_at_last_content: int | None = None  # cumulative usage as of the last content chunk
        self.itls: list[float] = []
        self.itl_from_usage = False
        self.finished = False

    def add(self, event: dict, now: float) -> None:
        usage = event.get("usage")
        chunk_usage = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(chunk_usage, int):
            self.usage_tokens = chunk_usage
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                self.finished = True
        if not self._has_content(event):
            return
        self.content_chunks += 1
        if self.first_at is None:
            self.first_at = now
        else:
            carried = 1
            # Usage counts the tokens between two content chunks only when both carried it: a server that
            # attaches its final usage to the last content chunk would otherwise credit it every token.
            if isinstance(chunk_usage, int) and self.tokens_at_last_content is not None \
                    and chunk_usage > self.tokens_at_last_content:
                carried = chunk_usage - self.tokens_at_last_content
                self.itl_from_usage = True
            self.itls.append((now - self.last_at) / carried)
        self.last_at = now
        self.tokens_at_last_content = chunk_usage if isinstance(chunk_usage, int) else None

    @staticmethod
    def _has_content(event: dict) -> bool:
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or choice.get("text"):
                return True
        return False

    def result(self, ended: float) -> RequestResult:
        if self.first_at is None:
            return RequestResult(False, "the stream ended without any content")
        return RequestResult(True, ttft_s=self.first_at - self.started, e2e_s=ended - self.started,
                             output_tokens=self.usage_tokens if self.usage_tokens is not None else self.content_chunks,
                             itls_s=self.itls, itl_tokens_from_usage=self.itl_from_usage)


def chat_body(target: Target, load: Load, prompt: str, model: str | None = None) -> dict:
    return {
        "model": model or target.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": load.output_len,
        "ignore_eos": True,  # every request produces exactly output_len tokens, on every server
        "temperature": load.temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **dict(load.extra_body),
    }


@dataclass(frozen=True)
class BenchApi:
    """An API the load can speak: where its requests go, their body, and its stream events as chat chunks."""
    path: str  # under the base URL
    body: Callable[[Target, Load, str, str | None], dict]  # (target, load, prompt, model) -> the JSON body
    chunk: Callable[[dict], dict | None] = lambda event: event  # a stream event as a chat chunk; None: skip it


# `pdserve bench --api` chooses among these; chat is the default.
APIS: dict[str, BenchApi] = {
    "chat": BenchApi("/chat/completions", chat_body),
    "completions": BenchApi("/completions", lambda target, load, prompt, model: completions_body(
        model or target.model, prompt, load.output_len, load.temperature, dict(load.extra_body))),
    "messages": BenchApi("/messages", lambda target, load, prompt, model: messages_body(
        model or target.model, prompt, load.output_len, load.temperature, dict(load.extra_body)), messages_chunk),
    "responses": BenchApi("/responses", lambda target, load, prompt, model: responses_body(
        model or target.model, prompt, load.output_len, load.temperature, dict(load.extra_body)), responses_chunk),
}


async def stream_chat(session: aiohttp.ClientSession, target: Target, load: Load, prompt: str,
                      model: str | None = None) -> RequestResult:
    """Send one streamed request (a chat completion, or `load.api`'s) and time it. Never raises (but for
    cancellation)."""
    api = APIS[load.api]
    timeout = aiohttp.ClientTimeout(total=load.timeout_s, sock_connect=min(30.0, load.timeout_s),
                                    sock_read=load.stall_timeout_s)
    started = time.perf_counter()
    tally = StreamTally(started)
    try:
        async with session.post(f"{target.base_url}{api.path}", json=api.body(target, load, prompt, model),
                                headers=target.headers(), timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:ERROR_TEXT_LIMIT]
                return RequestResult(False, f"HTTP {resp.status}: {' '.join(text.split())}")
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if not isinstance(event, dict) or (event := api.chunk(event)) is None:
                    continue
                if event.get("error"):
                    message = json.dumps(event["error"])[:ERROR_TEXT_LIMIT]
                    return RequestResult(False, f"error event: {message}")
                tally.add(event, time.perf_counter())
            ended = time.perf_counter()
        if not (done or tally.finished):
            return RequestResult(False, "the stream ended before [DONE]")
        return tally.result(ended)
    except asyncio.TimeoutError:
        elapsed = time.perf_counter() - started
        which = "whole-request" if elapsed >= load.timeout_s * 0.99 else "stall"
        limit = load.timeout_s if which == "whole-request" else load.stall_timeout_s
        return RequestResult(False, f"timed out ({which} limit {limit:g} s)")
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: malformed JSON or SSE line
        return RequestResult(False, f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------- a level


async def run_level(session: aiohttp.ClientSession, target: Target, load: Load, prompts: Sequence[str],
                    concurrency: int, on_error: Callable[[str], None],
                    on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send every prompt, at most `concurrency` in flight; returns the results and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    offsets = arrival_offsets(len(prompts), load.request_rate, load.seed + concurrency)
    start = time.perf_counter()

    async def one(i: int, prompt: str, offset: float) -> RequestResult:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        model = load.models[i % len(load.models)] if load.models else None
        async with gate:
            result = await stream_chat(session, target, load, prompt, model)
        if result.error:
            on_error(redact(result.error, target.api_key))
        if on_done:
            on_done(result)
        return result

    results = await asyncio.gather(*(one(i, p, o) for i, (p, o) in enumerate(zip(prompts, offsets))))
    return list(results), time.perf_counter() - start


# ---------------------------------------------------------------- a sweep


class ErrorReporter:
    """Prints each distinct error the first time it occurs, so a failing server does not flood the output."""

    def __init__(self, out=None) -> None:
        self.out = out or sys.stderr
        self.seen: set[str] = set()

    def __call__(self, error: str) -> None:
        if error not in self.seen:
            self.seen.add(error)
            print(f"[bench] request failed: {error}", file=self.out, flush=True)


def requests_for(concurrency: int, num_requests: int | None) -> int:
    """Four rounds of the concurrency by default; never fewer requests than streams."""
    return max(concurrency, num_requests if num_requests is not None else 4 * concurrency)


async def fetch_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None,
                      timeout_s: float = 30.0) -> str:
    """The first model id the server lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(f"{base_url}/models", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            text = redact((await resp.text(errors="replace"))[:ERROR_TEXT_LIMIT], api_key)
            raise RuntimeError(f"GET {base_url}/models answered HTTP {resp.status}: {text}")
        models = (await resp.json()).get("data") or []
    if not models:
        raise RuntimeError(f"GET {base_url}/models lists no model: pass --model")
    return models[0]["id"]


def _share_of_level(target: Target, load: Load, prompts: list[str], concurrency: int
                    ) -> tuple[list[RequestResult], float, float]:
    """One client process's part of a level: its results, and when it started and ended (wall clock)."""
    async def run() -> tuple[list[RequestResult], float, float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            start = time.time()
            results, _ = await run_level(session, target, load, prompts, concurrency, lambda error: None)
            return results, start, time.time()
    return asyncio.run(run())


async def run_level_in_processes(pool, processes: int, target: Target, load: Load, prompts: Sequence[str],
                                 concurrency: int, on_error: Callable[[str], None]) -> tuple[list[RequestResult], float]:
    """`run_level` from the `processes` processes of `pool` (a multiprocessing Pool): each takes an equal share of the
    streams, of the prompts (dealt in turn) and of the arrival rate; the wall time runs from the first start to
    the last end. For rates at which one Python process would be what limits the figures."""
    n = min(processes, concurrency)
    shares = [(list(prompts[i::n]), concurrency // n + (i < concurrency % n)) for i in range(n)]
    paced = replace(load, request_rate=load.request_rate / n)
    pending = [pool.apply_async(_share_of_level, (target, paced, p, c)) for p, c in shares if p]
    loop = asyncio.get_running_loop()
    done = await asyncio.gather(*(loop.run_in_executor(None, job.get) for job in pending))
    results = [r for part, _, _ in done for r in part]
    for result in results:
        if result.error:
            on_error(redact(result.error, target.api_key))
    return results, max(end for _, _, end in done) - min(start for _, start, _ in done)


async def run_sweep(target: Target, load: Load, concurrencies: Sequence[int], num_requests: int | None = None,
                    warmup: int = 0, on_error: Callable[[str], None] | None = None,
                    on_level: Callable[[LevelSummary], None] | None = None,
                    progress: Callable[[int, int], Callable[[RequestResult], None]] | None = None,
                    processes: int = 1) -> list[LevelSummary]:
    """`progress(concurrency, requests)`, if given, is called as each level starts and returns what is called
    as each of its requests ends. `processes` > 1: each level is sent from that many client processes
    (`run_level_in_processes`), without progress."""
    if processes > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            return await _sweep(target, load, concurrencies, num_requests, warmup, on_error, on_level, None,
                                (pool, processes))
    return await _sweep(target, load, concurrencies, num_requests, warmup, on_error, on_level, progress, None)


async def _sweep(target: Target, load: Load, concurrencies: Sequence[int], num_requests: int | None, warmup: int,
                 on_error: Callable[[str], None] | None, on_level: Callable[[LevelSummary], None] | None,
                 progress: Callable[[int, int], Callable[[RequestResult], None]] | None, clients
                 ) -> list[LevelSummary]:
    # Warm up, then one level per concurrency; each level gets prompts no earlier one has sent.
    on_error = on_error or ErrorReporter()
    counts = [requests_for(c, num_requests) for c in concurrencies]
    prompts = make_prompts(warmup + sum(counts), load.prompt_len, load.seed, load.workload)
    summaries: list[LevelSummary] = []
    # The pool may hold every stream of the largest level; the client must not be what limits concurrency.
    connector = aiohttp.TCPConnector(limit=max([*concurrencies, warmup, 1]))
    async with aiohttp.ClientSession(connector=connector) as session:
        if warmup:
            await run_level(session, target, load, prompts[:warmup], max(1, min(warmup, max(concurrencies))),
                            on_error)
        used = warmup
        for concurrency, count in zip(concurrencies, counts):
            if clients is not None:
                results, duration = await run_level_in_processes(*clients, target, load, prompts[used:used + count],
                                                                 concurrency, on_error)
            else:
                results, duration = await run_level(session, target, load, prompts[used:used + count], concurrency,
                                                    on_error, progress(concurrency, count) if progress else None)
            used += count
            summary = summarize(concurrency, results, duration, target.api_key)
            summaries.append(summary)
            if on_level:
                on_level(summary)
    return summaries
