"""What naming a checkpoint's weights by every byte costs a worker's start (shared/weights_digest.py, the `weights`
of the KV identity, kv_keys.py).

    .venv/bin/python benchmarks/bench_weights_digest.py [--model PATH] [--reps 5]

On a copy of the model (the default one, SmolLM2-135M-Instruct's 269 MB, unless --model names another) in a
temporary directory, each repetition times three starts in turn: the first on a machine (the files' pages
evicted from the kernel's page cache with posix_fadvise, so they come from the disk; no digest cached), one
after the files were read (in the page cache: a worker that started before, or the loader's own read; no digest
cached), and one with the digest cached (a `stat` per file). Beside them: reading the files alone, the same
reads from the page cache, and XXH3-128 alone over bytes in memory. Prints the median and range of each.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import xxhash

from pdserve.shared import weights_digest as wd

MB = 1e6


def evict(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(files: list[Path]) -> None:
    buffer = bytearray(wd.CHUNK)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF model directory (default: the default model)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.model:
        source = Path(args.model)
    else:
        from pdserve.shared.model_files import resolve_model_path

        source = resolve_model_path(None, quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / source.name
        model.mkdir()
        for path in wd.weight_files(source):
            shutil.copyfile(path, model / path.name)
        files = wd.weight_files(model)
        size = sum(p.stat().st_size for p in files)
        time.sleep(wd.RACY_S)  # files this fresh are not cached (see weights_digest.py)
        cache = model / wd.CACHE_NAME
        rows: dict[str, list[float]] = {k: [] for k in (
            "first start, from disk", "first start, page cache", "digest cached",
            "read alone, from disk", "read alone, page cache", "XXH3-128 alone, in memory")}
        blob = (model / files[-1].name).read_bytes()
        for _ in range(args.reps):
            cache.unlink(missing_ok=True)
            evict(files)
            rows["first start, from disk"].append(timed(lambda: wd.weights_digest(model)))
            cache.unlink(missing_ok=True)
            rows["first start, page cache"].append(timed(lambda: wd.weights_digest(model)))
            rows["digest cached"].append(timed(lambda: wd.weights_digest(model)))
            evict(files)
            rows["read alone, from disk"].append(timed(lambda: read_all(files)))
            rows["read alone, page cache"].append(timed(lambda: read_all(files)))
            rows["XXH3-128 alone, in memory"].append(timed(lambda: xxhash.xxh3_128_digest(blob)) * size / len(blob))
    print(f"{source}: {len(files)} files, {size / MB:.0f} MB, {args.reps} repetitions")
    print(f"{'':28s} {'median s':>9s} {'min':>7s} {'max':>7s} {'MB/s':>7s}")
    for name, times in rows.items():
        median = statistics.median(times)
        print(f"{name:28s} {median:9.3f} {min(times):7.3f} {max(times):7.3f} {size / MB / median:7.0f}")


if __name__ == "__main__":
    main()
