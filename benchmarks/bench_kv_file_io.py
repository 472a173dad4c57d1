"""The storage tier's page I/O: runs of page files written and read through NIXL's POSIX plugin against plain file
I/O (shared/kv_files.py, KVFiles.write_run / read_run, what the tier's threads call).

    .venv/bin/python benchmarks/bench_kv_file_io.py [--runs 8] [--pages 64] [--page-bytes 368640] [--reps 5]
        [--dir DIR] [--unkeyed]

A page is the default model's (SmolLM2-135M, bf16, page 16: 16 tokens x 30 layers x K and V x 3 KV heads x 64
x 2 bytes = 368,640 bytes). Each repetition, for each path in turn (the order alternating, ABBA): a fresh
directory, `runs` runs of `pages` pages written by one KVFiles, then read back by a fresh KVFiles (nothing of the
writer's kept; the files are in the kernel's page cache, as pages a worker wrote minutes ago would be) and
compared byte for byte. MB/s is page payload over wall time, file headers, MACs, temporary names and renames
included, as the tier pays them. The MAC (keyed BLAKE3, kv_file_access.py) over the same bytes alone is printed
beside them, and the transport alone: the files just written read whole, one `read` per file against one NIXL
transfer per run, no MAC. `--unkeyed` puts format 2's unkeyed XXH3-128 in the MAC's place (twice over, the same
header size): what the MAC costs, measured in the same conditions.
Exits 1 when a page read back differs or NIXL's POSIX plugin does not load.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import blake3
import numpy as np
import xxhash

from pdserve.shared.kv_file_io import nixl_file_io
from pdserve.shared.kv_files import KVFiles
from pdserve.shared.kv_keys import chain_keys, identity_key

MB = 1e6
PATHS = ("file", "nixl-posix")


def transport(files: KVFiles, keys: list[list[str]], io: str) -> float:
    """MB/s of the files of every run read whole by `io` alone: no header parsed, no MAC."""
    started = time.perf_counter()
    for run_keys in keys:
        if io == "file":
            for key in run_keys:
                with open(files._path(key), "rb") as f:
                    f.read(files.file_bytes)
        else:
            nixl_file_io().io.read([os.open(files._path(key), os.O_RDONLY) for key in run_keys], files.file_bytes)
    return sum(map(len, keys)) * files.page_bytes / (time.perf_counter() - started) / MB


def unkeyed(files: KVFiles) -> KVFiles:
    files.access.mac = lambda auth, payload: xxhash.xxh3_128_digest(payload) * 2
    return files


def one_pass(root: Path, io: str, runs: list[list[bytes]], rep: int, xxh3: bool = False) -> tuple[float, float, float]:
    """(write, read, transport alone) MB/s of every run through `io`, in a fresh directory under `root`."""
    directory = root / f"{io}-{rep}"
    page_bytes = len(runs[0][0])
    writer = KVFiles(str(directory), page_bytes, io=io)
    writer = unkeyed(writer) if xxh3 else writer
    writer.use(identity_key({"bench": io, "rep": rep}))
    keys = [chain_keys(writer.identity, [(r, p) for p in range(len(run))]) for r, run in enumerate(runs)]
    total = sum(len(run) for run in runs) * page_bytes
    started = time.perf_counter()
    for run_keys, run in zip(keys, runs):
        if not all(writer.write_run(run_keys, run)):
            sys.exit(f"{io}: a write failed ({writer.counts})")
    write_s = time.perf_counter() - started
    reader = KVFiles(str(directory), page_bytes, io=io)
    reader = unkeyed(reader) if xxh3 else reader
    reader.use(writer.identity)
    started = time.perf_counter()
    got = [reader.read_run(run_keys) for run_keys in keys]
    read_s = time.perf_counter() - started
    if got != runs:
        sys.exit(f"{io}: pages read back differ from those written ({reader.counts})")
    raw = transport(reader, keys, io)
    if writer.counts.io_fallbacks or reader.counts.io_fallbacks:
        print(f"  note: {io} fell back to plain I/O for {writer.counts.io_fallbacks + reader.counts.io_fallbacks} "
              "runs")
    shutil.rmtree(directory)
    return total / write_s / MB, total / read_s / MB, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8, help="runs written and read per pass (default 8)")
    parser.add_argument("--pages", type=int, default=64, help="pages per run (default 64)")
    parser.add_argument("--page-bytes", type=int, default=16 * 30 * 2 * 3 * 64 * 2, help="default 368640")
    parser.add_argument("--reps", type=int, default=5, help="passes of each path (default 5)")
    parser.add_argument("--dir", default=None, help="where the page files go (default: a temporary directory)")
    parser.add_argument("--unkeyed", action="store_true", help="XXH3-128 in the MAC's place (format 2's checksum)")
    args = parser.parse_args()
    if KVFiles(tempfile.gettempdir(), args.page_bytes, io="nixl-posix").io != "nixl-posix":
        sys.exit("NIXL's POSIX plugin does not load here: nothing to compare")
    rng = np.random.default_rng(0)
    runs = [[rng.integers(0, 256, args.page_bytes, dtype=np.uint8).tobytes() for _ in range(args.pages)]
            for _ in range(args.runs)]
    total = args.runs * args.pages * args.page_bytes
    started = time.perf_counter()
    for run in runs:
        for page in run:
            xxhash.xxh3_128_digest(page) if args.unkeyed else blake3.blake3(page, key=bytes(32)).digest()
    hash_mb_s = total / (time.perf_counter() - started) / MB
    print(f"{args.runs} runs x {args.pages} pages x {args.page_bytes:,} bytes = {total / MB:.0f} MB per pass, "
          f"{args.reps} passes per path; the {'XXH3-128' if args.unkeyed else 'MAC'} alone: {hash_mb_s:,.0f} MB/s")
    root = Path(tempfile.mkdtemp(prefix="bench-kv-file-io-", dir=args.dir))
    figures: dict[str, dict[str, list[float]]] = {io: {"write": [], "read": [], "transport": []} for io in PATHS}
    try:
        for rep in range(args.reps):
            for io in (PATHS if rep % 2 == 0 else PATHS[::-1]):
                write, read, raw = one_pass(root, io, runs, rep, args.unkeyed)
                for op, figure in (("write", write), ("read", read), ("transport", raw)):
                    figures[io][op].append(figure)
                print(f"  pass {rep + 1} {io:>10}: write {write:,.0f} MB/s, read {read:,.0f} MB/s "
                      f"(transport alone {raw:,.0f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'median MB/s':>16} {'plain':>8} {'nixl':>8} {'nixl/plain':>11}")
    for op in ("write", "read", "transport"):
        plain, nixl = (statistics.median(figures[io][op]) for io in PATHS)
        print(f"{op if op != 'transport' else 'read, transport':>16} {plain:>8,.0f} {nixl:>8,.0f} "
              f"{nixl / plain:>11.2f}")


if __name__ == "__main__":
    main()
