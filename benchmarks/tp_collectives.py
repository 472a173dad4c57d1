"""The collective half of benchmarks/bench_tp.py (an all-reduce between two pinned processes, gloo against
pdserve's ShmGroup), and how busy the rest of the machine was meanwhile; bench_tp.py documents both."""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import queue
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import servers

HIDDEN = 576  # SmolLM2-135M's hidden size: what a layer's all-reduce carries per token
SHAPES = ((1, HIDDEN), (32, HIDDEN))
DTYPES = ("float32", "bfloat16")
BACKENDS = ("gloo", "shm")


def say(message: str) -> None:
    print(f"[tp] {message}", flush=True)


# ---------------------------------------------------------------- other work on the machine

TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds every core has spent busy since boot (/proc/stat: user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / TICK


def ours_s(root: int | None) -> float:
    """CPU seconds of this process, the children it has waited for, and `root` with its living descendants (and
    the children they waited for)."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    if root is not None:
        for pid in [root, *(p for p, _ in servers.descendants(root))]:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in stat[11:15]) / TICK  # utime, stime, cutime, cstime
    return total


class Elsewhere:
    """How many cores other processes kept busy, on average, between `__init__` and `cores()`: the machine's busy
    time less this benchmark's and its servers'. Shared machines: a figure taken beside other work is not this
    code's alone, and tensor-parallel ranks pinned to a core each suffer most from it."""

    def __init__(self, root: int | None = None) -> None:
        self.root = root
        self.start = (time.monotonic(), machine_busy_s(), ours_s(root))

    def cores(self) -> float:
        wall, busy, ours = time.monotonic(), machine_busy_s(), ours_s(self.root)
        return max(0.0, (busy - self.start[1]) - (ours - self.start[2])) / max(wall - self.start[0], 1e-9)


# ---------------------------------------------------------------- collectives


@dataclass
class Collective:
    backend: str
    shape: tuple[int, int]
    dtype: str
    us_per_call: float | None  # rank 0's, the median block
    blocks_us: list[float]
    summed_right: bool
    error: str | None = None
    elsewhere_cores: float | None = None  # other processes' load meanwhile (Elsewhere)


def collective_rank(backend: str, rank: int, cpu: int, address: str, iters: int, blocks: int, warmup: int,
                    results) -> None:
    """One rank's process: pinned to `cpu`, one torch thread; every shape and dtype in turn, in step with the other
    rank. Puts (rank, {(rows, cols, dtype): (blocks' us per call, summed right)}) or (rank, error) on `results`."""
    try:
        os.sched_setaffinity(0, {cpu})
        torch.set_num_threads(1)
        if backend == "gloo":
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=60))
            reduce = dist.all_reduce
        else:
            from pdserve.shared.tp_group import Mailbox, ShmGroup

            reduce = ShmGroup(Mailbox(address, rank, 2, create=False), 60.0).all_reduce
        out = {}
        for shape in SHAPES:
            for name in DTYPES:
                x = torch.full(shape, float(rank + 1), dtype=getattr(torch, name))
                reduce(x)
                right = bool((x == 3).all())
                x.zero_()  # stays zero, in place: what is timed is the collective alone
                for _ in range(warmup):
                    reduce(x)
                times = []
                for _ in range(blocks):
                    start = time.perf_counter()
                    for _ in range(iters):
                        reduce(x)
                    times.append((time.perf_counter() - start) / iters * 1e6)
                out[(*shape, name)] = (times, right)
        if backend == "gloo":
            dist.destroy_process_group()
        results.put((rank, out))
    except BaseException as exc:  # the parent reports it; the other rank's wait ends at its timeout
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def measure_collective(backend: str, cpus: list[int], args: argparse.Namespace) -> list[Collective]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    box = None
    if backend == "gloo":
        address = f"tcp://127.0.0.1:{servers.free_port_base((0,))}"
    else:
        from pdserve.shared.tp_group import Mailbox

        box = Mailbox.create(2)  # both ranks attach to it; the file goes once they are done
        address = box.path
    procs = [ctx.Process(target=collective_rank, daemon=True,
                         args=(backend, r, cpus[r], address, args.ar_iters, args.ar_blocks, args.ar_warmup, results))
             for r in range(2)]
    got: dict[int, object] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.ar_timeout
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, out = results.get(timeout=1.0)
                got[rank] = out
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and not results.qsize():
                    break
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        if box is not None:
            box.unlink()
    errors = [f"rank {r}: {out}" for r, out in sorted(got.items()) if isinstance(out, str)]
    missing = [f"rank {r}: no result (exit code {procs[r].exitcode})" for r in range(2) if r not in got]
    rows = []
    for shape in SHAPES:
        for name in DTYPES:
            if errors or missing:
                rows.append(Collective(backend, shape, name, None, [], False, "; ".join(errors + missing)))
                continue
            times, right0 = got[0][(*shape, name)]
            _, right1 = got[1][(*shape, name)]
            rows.append(Collective(backend, shape, name, statistics.median(times), times, right0 and right1))
    return rows


def run_collectives(args: argparse.Namespace) -> list[Collective]:
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:2] if len(allowed) >= 2 else allowed * 2
    if len(allowed) < 2:
        say(f"only core {allowed[0]} is available: both ranks share it")
    say(f"all-reduce between 2 processes on cores {cpus[0]} and {cpus[1]}, one torch thread each: "
        f"{args.ar_blocks} blocks of {args.ar_iters} calls per case")
    rows = []
    for backend in BACKENDS:
        elsewhere = Elsewhere()
        found = measure_collective(backend, cpus, args)
        other = elsewhere.cores()
        for c in found:
            c.elsewhere_cores = other
        for c in found:
            figure = f"{c.us_per_call:.1f} us" if c.us_per_call is not None else f"failed: {c.error}"
            say(f"{backend} {list(c.shape)} {c.dtype}: {figure}{'' if c.summed_right or c.error else ', WRONG SUM'}")
        rows += found
    return rows


def collective_ratio(rows: list[Collective], shape: tuple[int, int], dtype: str) -> float | None:
    us = {c.backend: c.us_per_call for c in rows if c.shape == shape and c.dtype == dtype}
    gloo, shm = us.get("gloo"), us.get("shm")
    return gloo / shm if gloo is not None and shm else None


def print_collectives(rows: list[Collective]) -> None:
    print("\nall-reduce, 2 processes, one core and one torch thread each (us per call, median block)")
    table = [("shape", "dtype", "gloo us", "shm us", "gloo/shm", "sums right")]
    for shape in SHAPES:
        for name in DTYPES:
            mine = {c.backend: c for c in rows if c.shape == shape and c.dtype == name}
            cells = [f"{mine[b].us_per_call:.1f}" if b in mine and mine[b].us_per_call is not None else "-"
                     for b in BACKENDS]
            ratio = collective_ratio(rows, shape, name)
            right = ", ".join(f"{b} {'yes' if mine[b].summed_right else 'no'}" for b in BACKENDS if b in mine)
            table.append((str(list(shape)), name.replace("float32", "fp32").replace("bfloat16", "bf16"), *cells,
                          "-" if ratio is None else f"{ratio:.1f}", right))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) if i < 2 or i == 5 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    for c in rows:
        if c.error:
            print(f"{c.backend} failed: {c.error}")
            break
