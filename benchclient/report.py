"""`pdserve bench` results: what one request measured, the statistics of a level, and their table.

`RequestResult` (one request) -> `summarize` -> `LevelSummary` (one concurrency level: throughput, TTFT, ITL,
TPOT and end-to-end percentiles, distinct errors) -> `format_table` / `format_errors`. Percentiles
interpolate linearly between the closest ranks; a level without a successful request has None for them.
Errors are shown with the API key redacted.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


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


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


# ---------------------------------------------------------------- statistics


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
