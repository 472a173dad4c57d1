"""Which kernel computes the CPU's bf16 weight matmuls in the default mode: decided by timing both on this machine
once, then read back, so the choice (and with it the numerics) does not change from one start to the next.

Two kernels can compute a layer (shared/linear.py): oneDNN (with the native GEMV at 1-4 rows), whose kernel and
summation order change with the row count and the CPU, and the native fixed-order kernel (FixedOrderMatmul),
which gives a row the same bits at every row count. Which is faster depends on the CPU: on AMD's AVX512-BF16
cores the fixed-order kernel measured 0.5-1.0x oneDNN's time; Intel's AVX512-BF16 cores without AMX multiply bf16
slower than fp32, and AMX tiles faster than anything else, untimed here until measured. Two choices are made:
- `layers`: the bf16 layers of the model (bf16 in, bf16 out);
- `head`: the layers with fp32 output (the LM head, and a tensor-parallel row-parallel layer's partial sums),
  where oneDNN's alternative multiplies an fp32 copy of the weight (torch has no bf16 x bf16 -> fp32 matmul on
  the CPU).

The probe (`measure`): the default model's layer shapes (qkv, o, gate_up, down) and a slice of its LM head
(PROBE_HEAD_ROWS of its 49,152 outputs: the kernels' time is linear in them) at PROBE_ROWS rows, one thread,
the two kernels called alternately, the median of `reps` calls each; about half a second. A kernel wins when,
at each row count, a step's matmuls (the sum over the shapes) are compared and the geometric mean over the row
counts of fixed / oneDNN is at most TOLERANCE: the fixed-order kernel may cost that much more, since its rows'
bits also do not depend on the batch. The timings and the choice are written to
`$PDSERVE_CACHE_DIR/matmul/<key>.json` (default ~/.cache/pdserve), the key naming the CPU model and the native
build (its sources, torch, the CPU's flags, -march); delete the file to time again.
`benchmarks/bench_matmul_choice.py` prints the whole table (1-1,024 rows, each shape, the decode step), and
PDSERVE_CPU_MATMUL=fixed|onednn overrides both choices.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.shared.model_files import cache_root

log = logging.getLogger(__name__)

# (name, [out_features, in_features], fp32 output): SmolLM2-135M's layers, and its LM head cut to PROBE_HEAD_ROWS.
PROBE_HEAD_ROWS = 8192
PROBE_SHAPES = (("qkv", (960, 576), False), ("o", (576, 576), False), ("gate_up", (3072, 576), False),
                ("down", (576, 1536), False), ("lm_head", (PROBE_HEAD_ROWS, 576), True))
PROBE_ROWS = (1, 4, 16, 64)
TOLERANCE = 1.05
FORMAT = 1  # of the cached file: another format is timed again


@dataclass(frozen=True)
class Timing:
    shape: str
    rows: int
    fixed_us: float
    onednn_us: float


@dataclass(frozen=True)
class MatmulChoice:
    layers: bool  # bf16 layers on the fixed-order kernel
    head: bool  # fp32-output layers on the fixed-order kernel
    timings: tuple[Timing, ...]
    source: str  # where the choice came from: the cache file, or "measured" (not written)

    def ratio(self, head: bool) -> float:
        return ratio(self.timings, head)


def ratio(timings: tuple[Timing, ...] | list[Timing], head: bool) -> float:
    """Geometric mean over the row counts of (sum of fixed-order times) / (sum of oneDNN times), over the probe's
    bf16 layers (`head` False) or its fp32-output layer (True)."""
    heads = {name for name, _, fp32 in PROBE_SHAPES if fp32}
    picked = [t for t in timings if (t.shape in heads) is head]
    rows = sorted({t.rows for t in picked})
    if not rows:
        raise ValueError("no timings of " + ("the fp32-output layer" if head else "the bf16 layers"))
    logs = [math.log(sum(t.fixed_us for t in picked if t.rows == r) / sum(t.onednn_us for t in picked if t.rows == r))
            for r in rows]
    return math.exp(sum(logs) / len(logs))


def decide(timings: tuple[Timing, ...] | list[Timing], source: str) -> MatmulChoice:
    timings = tuple(timings)
    return MatmulChoice(ratio(timings, False) <= TOLERANCE, ratio(timings, True) <= TOLERANCE, timings, source)


def time_pair(fixed: Callable[[], object], onednn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median microseconds of each, called alternately (so a drift of the machine moves both alike)."""
    fixed(), onednn()
    a, b = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fixed()
        t1 = time.perf_counter()
        onednn()
        t2 = time.perf_counter()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6


def cache_key(cpu_model: str, build: str) -> str:
    return hashlib.sha1(f"{cpu_model}\n{build}".encode()).hexdigest()[:16]


def cache_path(key: str) -> Path:
    return cache_root() / "matmul" / f"{key}.json"


def load_or_measure(key: str, measure: Callable[[], list[Timing]], describe: dict) -> MatmulChoice:
    """The choice cached under `key`, else `measure()`d now and cached (`describe` is written beside the timings
    so that a reader of the file knows the machine). A file that cannot be read or written only costs a probe."""
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT:
            return decide([Timing(**t) for t in data["timings"]], str(path))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    timings = measure()
    choice = decide(timings, "measured")
    record = {"format": FORMAT, **describe, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "layers_ratio": round(choice.ratio(False), 4), "head_ratio": round(choice.ratio(True), 4),
              "timings": [asdict(t) for t in timings]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)  # whole or absent: starts that race read one probe's file or time their own
        return decide(timings, str(path))
    except OSError as exc:
        log.warning("could not cache the CPU matmul kernel choice in %s: %s", path, exc)
        return choice
