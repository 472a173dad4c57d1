"""Request traces: the public formats read into one list of arrivals, and synthetic traces written in Azure's.

A `Trace` is requests sorted by arrival, the first at 0 s. Formats:

- Azure LLM inference trace (CSV): `TIMESTAMP,ContextTokens,GeneratedTokens`, the timestamp a datetime string
  (`2023-11-16 18:15:46.6805900`) or seconds.
- Mooncake (JSONL): one object per line with `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, the
  ids of the prompt's 512-token blocks: two prompts that share leading ids share that prefix.
- BurstGPT (CSV): `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`, the timestamp in seconds.
  Rows with 0 response tokens are failed requests in that trace and are left out (`Trace.skipped` counts them).

A malformed file is refused with a `TraceError` naming the file, line and field. `time_scale` multiplies every
arrival time: 0.5 replays the trace at twice its rate.
"""
from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK = 512
FORMATS = ("azure", "mooncake", "burstgpt")
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_HEADER = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


class TraceError(ValueError):
    """A trace file that cannot be read, with where and why."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # ids of the prompt's leading blocks (Mooncake); () shares nothing


@dataclass
class Trace:
    requests: list[TraceRequest]
    source: str = ""
    format: str = ""
    block_size: int = MOONCAKE_BLOCK  # tokens per hash id
    skipped: int = 0  # rows the format marks as failed requests
    extra: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def __len__(self) -> int:
        return len(self.requests)


def read_trace(path: str | Path, format: str | None = None, time_scale: float = 1.0) -> Trace:
    """Read `path` (format from its extension and header unless `format` names one); arrivals scaled by `time_scale`."""
    path = Path(path)
    if not time_scale > 0:
        raise TraceError(f"time scale must be > 0, got {time_scale}")
    if format is not None and format not in FORMATS:
        raise TraceError(f"unknown trace format {format!r}; choose one of {', '.join(FORMATS)}")
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it ({exc.strerror})") from None
    lines = text.splitlines()
    if format is None:
        format = detect(path, lines)
    reader = {"azure": _azure, "mooncake": _mooncake, "burstgpt": _burstgpt}[format]
    rows, skipped = reader(path, lines)
    if not rows:
        raise TraceError(f"{path}: no requests in it")
    rows.sort(key=lambda r: r.arrival_s)
    start = rows[0].arrival_s
    requests = [TraceRequest((r.arrival_s - start) * time_scale, r.input_len, r.output_len, r.hash_ids) for r in rows]
    return Trace(requests, str(path), format, skipped=skipped)


def detect(path: Path, lines: list[str]) -> str:
    first = next((line for line in lines if line.strip()), "")
    if first.lstrip().startswith("{"):
        return "mooncake"
    header = tuple(h.strip() for h in first.split(","))
    if header[:3] == AZURE_HEADER:
        return "azure"
    if header[:4] == BURSTGPT_HEADER[:4]:
        return "burstgpt"
    raise TraceError(f"{path}: line 1: not a known trace format (an Azure CSV starts {','.join(AZURE_HEADER)}; "
                     f"a BurstGPT CSV {','.join(BURSTGPT_HEADER)}; Mooncake is JSON lines)")


def _int(path: Path, line: int, name: str, value: object) -> int:
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool):
        raise TraceError(f"{path}: line {line}: {name} must be a whole number, got {value!r}")
    if number < 0:
        raise TraceError(f"{path}: line {line}: {name} must be >= 0, got {number}")
    return number


def _seconds(path: Path, line: int, name: str, value: str) -> float:
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            raise TraceError(f"{path}: line {line}: {name} must be a date-time or seconds, got {value!r}") from None
    if not math.isfinite(seconds):
        raise TraceError(f"{path}: line {line}: {name} must be finite, got {value!r}")
    return seconds


def _csv_rows(path: Path, lines: list[str], header: tuple[str, ...]):
    rows = csv.reader(lines)
    got = tuple(h.strip() for h in next(rows, ()))
    missing = [h for h in header if h not in got]
    if missing:
        raise TraceError(f"{path}: line 1: missing column(s) {', '.join(missing)}; the header is {','.join(got)}")
    index = {h: got.index(h) for h in header}
    for number, row in enumerate(rows, start=2):
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) < len(got):
            raise TraceError(f"{path}: line {number}: {len(row)} fields, the header has {len(got)}")
        yield number, {h: row[i] for h, i in index.items()}


def _azure(path: Path, lines: list[str]) -> tuple[list[TraceRequest], int]:
    out = []
    for n, row in _csv_rows(path, lines, AZURE_HEADER):
        out.append(TraceRequest(_seconds(path, n, "TIMESTAMP", row["TIMESTAMP"]),
                                _int(path, n, "ContextTokens", row["ContextTokens"].strip()),
                                _int(path, n, "GeneratedTokens", row["GeneratedTokens"].strip())))
    return out, 0


def _burstgpt(path: Path, lines: list[str]) -> tuple[list[TraceRequest], int]:
    out, skipped = [], 0
    for n, row in _csv_rows(path, lines, BURSTGPT_HEADER[:4]):
        output = _int(path, n, "Response tokens", row["Response tokens"].strip())
        if output == 0:
            skipped += 1
            continue
        out.append(TraceRequest(_seconds(path, n, "Timestamp", row["Timestamp"]),
                                _int(path, n, "Request tokens", row["Request tokens"].strip()), output))
    return out, skipped


def _mooncake(path: Path, lines: list[str]) -> tuple[list[TraceRequest], int]:
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: line {n}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise TraceError(f"{path}: line {n}: expected a JSON object")
        for name in ("timestamp", "input_length", "output_length"):
            if name not in item:
                raise TraceError(f"{path}: line {n}: missing field {name!r}")
        stamp = item["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
            raise TraceError(f"{path}: line {n}: timestamp must be a number of milliseconds, got {stamp!r}")
        hashes = item.get("hash_ids", [])
        if not isinstance(hashes, list):
            raise TraceError(f"{path}: line {n}: hash_ids must be a list of integers, got {hashes!r}")
        ids = tuple(_int(path, n, "hash_ids", h) for h in hashes)
        length = _int(path, n, "input_length", item["input_length"])
        if len(ids) > -(-length // MOONCAKE_BLOCK):
            raise TraceError(f"{path}: line {n}: {len(ids)} hash_ids of {MOONCAKE_BLOCK} tokens are more than "
                             f"input_length {length} holds")
        out.append(TraceRequest(stamp / 1000.0, length, _int(path, n, "output_length", item["output_length"]), ids))
    return out, 0


# ------------------------------------------------------------ prompts of exact lengths


def prompt_ids(req: TraceRequest, unique: int, block_size: int = MOONCAKE_BLOCK, low: int = 1000,
               span: int = 30000) -> list[int]:
    """`req.input_len` token ids in [low, low + span): each hash id's block the same wherever it appears (so shared
    ids are shared prefixes), the rest of the prompt distinct for each `unique` (a request's index)."""
    ids: list[int] = []
    for h in req.hash_ids:
        ids += [low + (h * 7919 + k * 104729) % span for k in range(block_size)]
    rest = req.input_len - len(ids)
    ids = ids[:req.input_len]
    ids += [low + (unique * 15485863 + (k + 1) * 32452843) % span for k in range(max(0, rest))]
    return ids


def sim_prompt_ids(req: TraceRequest, unique: int, block_size: int = MOONCAKE_BLOCK) -> list[int]:
    """Token ids for a simulated prompt, where no vocabulary bounds them: the same sharing as `prompt_ids`
    (blocks of a hash id negative, the rest from a range of the request's own), built at C speed."""
    ids: list[int] = []
    for h in req.hash_ids:
        ids.extend(range(-(h + 1) * block_size, -h * block_size))
    del ids[req.input_len:]
    base = (unique + 1) << 24
    ids.extend(range(base, base + req.input_len - len(ids)))
    return ids


# ------------------------------------------------------------ synthetic traces


def synthetic(rate: float, duration_s: float, input_median: int = 512, output_median: int = 128,
              sigma: float = 0.6, max_input: int = 4096, max_output: int = 1024, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `rate` per second for `duration_s`, lognormal prompt and output lengths."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        prompt = min(max_input, max(1, round(rng.lognormvariate(math.log(input_median), sigma))))
        answer = min(max_output, max(1, round(rng.lognormvariate(math.log(output_median), sigma))))
        out.append(TraceRequest(t, prompt, answer))
        t += rng.expovariate(rate)
    return out


def two_phase(rates: tuple[float, float], phase_s: float, long: int = 1024, short: int = 32, answer: int = 8,
              story: int = 256, seed: int = 0) -> list[TraceRequest]:
    """Three phases of `phase_s` each, so the load changes side twice: long prompts (`long` tokens) with short
    answers (`answer`) at rates[0] per second, short prompts (`short`) with long answers (`story`) at rates[1],
    then long prompts again. Poisson arrivals, lognormal lengths around these medians."""
    out: list[TraceRequest] = []
    for i, (prompt, output, rate) in enumerate([(long, answer, rates[0]), (short, story, rates[1]),
                                                (long, answer, rates[0])]):
        phase = synthetic(rate, phase_s, prompt, output, sigma=0.3, max_input=4 * prompt, max_output=4 * output,
                          seed=seed + i)
        out += [TraceRequest(r.arrival_s + i * phase_s, r.input_len, r.output_len) for r in phase]
    return out


def write_azure(path: str | Path, requests: list[TraceRequest], start: str = "2023-11-16 18:00:00") -> None:
    """Write `requests` as an Azure LLM inference trace CSV (datetime timestamps, 7 fraction digits as Azure's)."""
    base = datetime.fromisoformat(start).timestamp()
    with open(path, "w", newline="") as f:
        f.write(",".join(AZURE_HEADER) + "\n")
        for r in requests:
            stamp = datetime.fromtimestamp(base + r.arrival_s).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
            f.write(f"{stamp},{r.input_len},{r.output_len}\n")
