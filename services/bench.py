"""`pdserve bench`: streaming chat load against any OpenAI-compatible server, and its latency statistics.

    pdserve bench --base-url http://127.0.0.1:30000/v1 --concurrency 1,8,32 [--output-len 128]
                  [--prompt-len 40] [--num-requests N] [--request-rate R] [--warmup 2] [--json FILE]

A run: resolve the model (`GET /models`, its first id, unless `--model`) -> warm-up requests (not measured)
-> for each concurrency level, `num_requests` streamed chat completions with at most `concurrency` in flight
(closed loop; with `--request-rate`, requests also arrive as a Poisson process) -> one `RequestResult` per
request -> one `LevelSummary` per level -> a table, and JSON if asked.

Each request asks for exactly `output_len` tokens (`max_tokens` with `ignore_eos`), greedy unless
`--temperature`. Prompts are distinct (seeded words), so a prefix cache cannot serve one from another.

Token counting: the total output of a request is the `usage.completion_tokens` of its final chunk
(`stream_options.include_usage`). Each content chunk after the first adds one inter-token latency sample:
the time since the previous content chunk divided by the tokens this chunk carries. Those tokens come from
the per-chunk usage the server sends under `stream_options.continuous_usage_stats` (cumulative
`completion_tokens`); a server that does not send it is counted as one token per content chunk, and the
summary's `itl_tokens_from` says which ("usage" or "chunks").

Failures never stop a run: a request that fails (HTTP error, error event, timeout, broken stream) is counted,
and each distinct error is printed once. The API key is sent, never printed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

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


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itls_s: list[float] = field(default_factory=list)
    itl_tokens_from_usage: bool = False  # the chunks carried cumulative usage

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LevelSummary:
    concurrency: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    request_s: float
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    ttft_ms_p99: float | None
    itl_ms_p50: float | None
    itl_ms_p90: float | None
    itl_ms_p99: float | None
    tpot_ms_p50: float | None
    e2e_ms_p50: float | None
    itl_tokens_from: str  # "usage" (per-chunk usage) or "chunks" (one token per content chunk)
    errors: dict[str, int] = field(default_factory=dict)  # distinct error -> count


# ---------------------------------------------------------------- prompts


def make_prompts(count: int, prompt_len: int, seed: int) -> list[str]:
    """`count` distinct prompts of about `prompt_len` tokens; the same seed gives the same prompts."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(max(1, prompt_len))) for _ in range(count)]


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


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


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


async def stream_chat(session: aiohttp.ClientSession, target: Target, load: Load, prompt: str,
                      model: str | None = None) -> RequestResult:
    """Send one streamed chat completion and time it. Never raises (but for cancellation)."""
    timeout = aiohttp.ClientTimeout(total=load.timeout_s, sock_connect=min(30.0, load.timeout_s),
                                    sock_read=load.stall_timeout_s)
    started = time.perf_counter()
    tally = StreamTally(started)
    try:
        async with session.post(f"{target.base_url}/chat/completions", json=chat_body(target, load, prompt, model),
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
                if not isinstance(event, dict):
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


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linearly interpolated between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(values: Sequence[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else p * 1e3


def summarize(concurrency: int, results: Sequence[RequestResult], duration_s: float,
              api_key: str | None = None) -> LevelSummary:
    good = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    itls = [x for r in good for x in r.itls_s]
    tpots = [t for r in good if (t := r.tpot_s) is not None]
    e2es = [r.e2e_s for r in good if r.e2e_s is not None]
    tokens = sum(r.output_tokens for r in good)
    errors = Counter(redact(r.error or "unknown error", api_key) for r in results if not r.ok)
    return LevelSummary(
        concurrency=concurrency, requests=len(results), completed=len(good), failed=len(results) - len(good),
        duration_s=duration_s, output_tokens=tokens,
        output_tok_s=tokens / duration_s if duration_s > 0 else 0.0,
        request_s=len(good) / duration_s if duration_s > 0 else 0.0,
        ttft_ms_p50=_ms(ttfts, 50), ttft_ms_p90=_ms(ttfts, 90), ttft_ms_p99=_ms(ttfts, 99),
        itl_ms_p50=_ms(itls, 50), itl_ms_p90=_ms(itls, 90), itl_ms_p99=_ms(itls, 99),
        tpot_ms_p50=_ms(tpots, 50), e2e_ms_p50=_ms(e2es, 50),
        itl_tokens_from="usage" if any(r.itl_tokens_from_usage for r in good) else "chunks",
        errors=dict(errors))


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


async def run_sweep(target: Target, load: Load, concurrencies: Sequence[int], num_requests: int | None = None,
                    warmup: int = 0, on_error: Callable[[str], None] | None = None,
                    on_level: Callable[[LevelSummary], None] | None = None,
                    progress: Callable[[int, int], Callable[[RequestResult], None]] | None = None
                    ) -> list[LevelSummary]:
    """`progress(concurrency, requests)`, if given, is called as each level starts and returns what is called
    as each of its requests ends."""
    # Warm up, then one level per concurrency; each level gets prompts no earlier one has sent.
    on_error = on_error or ErrorReporter()
    counts = [requests_for(c, num_requests) for c in concurrencies]
    prompts = make_prompts(warmup + sum(counts), load.prompt_len, load.seed)
    summaries: list[LevelSummary] = []
    # The pool may hold every stream of the largest level; the client must not be what limits concurrency.
    connector = aiohttp.TCPConnector(limit=max([*concurrencies, warmup, 1]))
    async with aiohttp.ClientSession(connector=connector) as session:
        if warmup:
            await run_level(session, target, load, prompts[:warmup], max(1, min(warmup, max(concurrencies))),
                            on_error)
        used = warmup
        for concurrency, count in zip(concurrencies, counts):
            results, duration = await run_level(session, target, load, prompts[used:used + count], concurrency,
                                                on_error, progress(concurrency, count) if progress else None)
            used += count
            summary = summarize(concurrency, results, duration, target.api_key)
            summaries.append(summary)
            if on_level:
                on_level(summary)
    return summaries


# ---------------------------------------------------------------- output

COLUMNS = (  # header, field, format
    ("conc", "concurrency", "{:d}"), ("ok", "completed", "{:d}"), ("failed", "failed", "{:d}"),
    ("dur s", "duration_s", "{:.1f}"), ("out tok/s", "output_tok_s", "{:.1f}"), ("req/s", "request_s", "{:.2f}"),
    ("TTFT p50", "ttft_ms_p50", "{:.1f}"), ("p90", "ttft_ms_p90", "{:.1f}"), ("p99", "ttft_ms_p99", "{:.1f}"),
    ("ITL p50", "itl_ms_p50", "{:.1f}"), ("p90", "itl_ms_p90", "{:.1f}"), ("p99", "itl_ms_p99", "{:.1f}"),
    ("TPOT p50", "tpot_ms_p50", "{:.1f}"), ("E2E p50", "e2e_ms_p50", "{:.0f}"),
)


def format_table(summaries: Sequence[LevelSummary], label_header: str | None = None,
                 labels: Sequence[str] | None = None) -> str:
    """Aligned rows, times in ms; an optional leading label column (e.g. the server of each row)."""
    header = [h for h, _, _ in COLUMNS]
    rows = [[("-" if (v := getattr(s, name)) is None else fmt.format(v)) for _, name, fmt in COLUMNS]
            for s in summaries]
    if label_header is not None and labels is not None:
        header = [label_header, *header]
        rows = [[label, *row] for label, row in zip(labels, rows)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    first_numeric = 1 if label_header is not None else 0

    def line(cells: list[str]) -> str:  # labels to the left, numbers to the right
        return "  ".join(c.ljust(w) if i < first_numeric else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), *(line(r) for r in rows)])


def format_errors(summaries: Sequence[LevelSummary]) -> str:
    lines = [f"  concurrency {s.concurrency}: {count} x {error}"
             for s in summaries for error, count in s.errors.items()]
    return "failed requests:\n" + "\n".join(lines) if lines else ""


# ---------------------------------------------------------------- CLI


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
    parser.add_argument("--extra-body", default=None, metavar="JSON",
                        help='more fields for every request, e.g. \'{"response_format": {"type": "json_object"}}\'')


def load_from_args(args: argparse.Namespace) -> Load:
    if args.output_len < 1 or args.prompt_len < 1:
        raise ValueError("--output-len and --prompt-len must be at least 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be positive (inf for a closed loop)")
    if args.timeout <= 0 or args.stall_timeout <= 0:
        raise ValueError("--timeout and --stall-timeout must be positive")
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
                models=tuple(m for m in (args.models or "").split(",") if m))


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
    rate = "closed loop" if math.isinf(load.request_rate) else f"{load.request_rate:g} req/s Poisson"
    print(f"[bench] {base_url} model {model}: {load.output_len} output tokens, ~{load.prompt_len}-token prompts, "
          f"{rate}, concurrency {','.join(map(str, concurrencies))}", flush=True)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    bars = ProgressBars() if show else None
    summaries = await run_sweep(target, load, concurrencies, args.num_requests, args.warmup,
                                on_level=lambda s: (bars and bars.close()) or print(
                                    f"[bench] concurrency {s.concurrency}: {s.completed} ok, {s.failed} failed "
                                    f"in {s.duration_s:.1f} s", flush=True),
                                progress=bars.level if bars else None)
    print(format_table(summaries))
    print(f"(times in ms; ITL tokens counted from {', '.join(sorted({s.itl_tokens_from for s in summaries}))})")
    if errors := format_errors(summaries):
        print(errors)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report(target, load, summaries), f, indent=2)
    if args.plot:
        from pdserve.services.bench_plot import plot

        print(f"[bench] plot: {plot(summaries, args.plot, f'{model} at {base_url}')}")
    return 0 if all(s.completed for s in summaries) else 1


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
