"""`pdserve profile`: measure what a step costs on this machine, for the simulator (costs.py owns the fit).

The runtime's own engine runs each measurement: prefill of a prompt of each length after a cached prefix of each
size (the prefix computed first, then the timed prompt continuing it), decode steps at each batch size and context
(the requests share their context's prefix, so one prefill sets up a long context for a whole batch; attention
still reads every page of each), and a KV transfer of each size through the transfer backend's own benchmark
(`shared/transfer/bench.py`: between two processes, pages as the allocator lays them out). Prefill is measured with
the threads a prefill worker of `pdserve up` gets here, decode with a decode worker's. The gateway's overheads are
measured as the gateway spends them: the chat template and tokenization of a prompt once per request, incremental
detokenization per token. Each point is the best of a few runs (a shared machine only ever slows a run down).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from pdserve.planning.costs import PROFILE_VERSION

FULL = {"prefill": [(n, c) for n in (64, 256, 1024, 2048) for c in (0, n // 2)],
        "decode": [(b, ctx) for b in (1, 8, 32) for ctx in (64, 1024)],
        "transfer": (256, 2048, 8192), "reps": 2, "steps": 6, "transfer_iters": 5}
QUICK = {"prefill": [(32, 0), (128, 0), (128, 64)], "decode": [(1, 32), (4, 32), (4, 128)],
         "transfer": (64, 512), "reps": 1, "steps": 4, "transfer_iters": 2}


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    cpus = os.cpu_count() or 1
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the profile (JSON)")
    parser.add_argument("--model-path", default=None, help="the model (default: the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kernels", default="auto", help="the kernel set the workers run (auto | native | torch | triton)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="the KV pool size the simulation gives "
                                                                            "each worker")
    parser.add_argument("--prefill-threads", type=int, default=max(1, cpus // 2),
                        help="threads of a prefill worker (default: what `pdserve up` gives one here, PD 1:1)")
    parser.add_argument("--decode-threads", type=int, default=cpus, help="threads of a decode worker")
    parser.add_argument("--transfer-backend", default="auto", choices=["auto", "nixl", "tcp"],
                        help="KV transfer backend (auto: nixl where it is installed, else tcp)")
    parser.add_argument("--quick", action="store_true", help="a few points only (seconds, for a smoke test)")


def run_profile(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
    from pdserve.shared.engine import Engine
    from pdserve.shared.model_files import resolve_model_path

    grid = QUICK if args.quick else FULL
    started = time.perf_counter()
    model_dir = resolve_model_path(args.model_path, quiet=True)
    longest = max([n for n, _ in grid["prefill"]] + [ctx + 16 for _, ctx in grid["decode"]])
    engine = Engine(RuntimeConfig(
        model_path=str(model_dir), dtype=args.dtype, kernels=args.kernels, device=args.device,
        cache=CacheConfig(page_size=args.page_size, max_total_tokens=max(args.max_total_tokens, 4 * longest)),
        scheduler=SchedulerConfig(max_running_requests=256, chunked_prefill_size=-1, max_prefill_tokens=1 << 20)))
    backend = args.transfer_backend
    if backend == "auto":
        import importlib.util

        backend = "nixl" if importlib.util.find_spec("nixl") is not None else "tcp"
    work = [("prefill", p) for p in grid["prefill"]] + [("decode", d) for d in grid["decode"]] + \
        [("transfer", t) for t in grid["transfer"]] + [("overheads", None)]
    profile: dict = {"prefill": [], "decode": [], "transfer": []}
    from pdserve.planning.measure import measure_decode, measure_overheads, measure_prefill, measure_transfer

    for threads in (args.prefill_threads, args.decode_threads):  # first use: kernels built, thread pools made
        torch.set_num_threads(threads)
        measure_prefill(engine, 2 * args.page_size, 0, reps=1)
        measure_decode(engine, 2, 2 * args.page_size, steps=2)
    for kind, point in tqdm(work, desc="profiling", unit="point"):
        if kind == "prefill":
            torch.set_num_threads(args.prefill_threads)
            profile["prefill"].append(measure_prefill(engine, *point, reps=grid["reps"]))
        elif kind == "decode":
            torch.set_num_threads(args.decode_threads)
            profile["decode"].append(measure_decode(engine, *point, steps=grid["steps"]))
        elif kind == "transfer":
            profile["transfer"].append(measure_transfer(backend, point, args.page_size, grid["transfer_iters"]))
        else:
            profile["overheads"] = measure_overheads(model_dir)
    layout = engine.runner.pool.layout
    from pdserve.shared.kv_keys import cpu_class

    out = {"version": PROFILE_VERSION,
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "cpu": cpu_class()},
           "device": args.device, "model": model_dir.name, "model_path": str(model_dir),
           "dtype": str(engine.runner.model.dtype).removeprefix("torch."), "kernels": args.kernels, "tp": 1,
           "threads": {"prefill": args.prefill_threads, "decode": args.decode_threads},
           "transfer_backend": backend, "page_size": args.page_size, "max_total_tokens": args.max_total_tokens,
           "kv_bytes_per_token": layout.page_bytes // layout.page_size,
           **profile, "seconds_taken": round(time.perf_counter() - started, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"profile of {out['model']} ({out['dtype']}, {backend} transfer) written to {args.out} in "
          f"{out['seconds_taken']:.0f} s")
    return 0
