"""Tensor parallelism on several devices: greedy output of TP 1 and TP N, and decode step times at batch 1 and 64.

    python benchmarks/gpu_tp.py --model-path DIR [--tp-size 2] [--rounds 4] [--json FILE]   # >= 2 GPUs
    python benchmarks/gpu_tp.py --model-path DIR --device cpu [--rounds 6] [--threads N]    # ranks on a CPU's cores
    python benchmarks/gpu_tp.py --model-path DIR --device cpu --dry-run                     # the script's plumbing

(1) Greedy fp32 tokens of a few prompts, TP 1 (one device) against TP N (rank r on device r, NCCL between
them), through the engine with every prompt batched: identical, and the largest logprob difference. (2) bf16
decode step time at batch 1 and 64 (prompts of 128 tokens prefilled first), the median of each run's timed
steps, TP 1 and TP N, and their quotient. The model is whatever --model-path holds (gpu_check.sh: SmolLM2-135M's
shape with random weights, whose 3 KV-head groups split 2 + 1 over two ranks).

Every run is a process of its own, started afresh with the same settings: `--threads` compute threads in all
(default: every core this process may use; TP 1 computes on all of them in one process, TP N splits them
between its ranks) and one inter-op thread, so that no arm inherits another's threads, cores or warm caches.
The step times are taken in `--rounds` rounds, TP 1 and TP N once each, their order rotating from round to
round (TP 1 first, then TP N first: benchmarks/arms.py); printed as the median and spread over the rounds, and
TP 1 / TP N as the quotient of the medians and the range of the per-round quotients. On the CPU (--device cpu)
the ranks run on their own cores with the shared-memory all-reduce; --dry-run shortens every part (2 rounds):
it checks the script.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from arms import Ratio, Spread, order
from pdserve.shared.config import CacheConfig, ModelConfig, Role, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch
from pdserve.shared.tp_ranks import Launch, Ranks, cpu_sets

PROMPTS = [[1, 520, 33, 900, 12, 7, 4410, 88, 301], [1, 2, 3, 4, 5], list(range(100, 160))]
RESULT = "gpu_tp-result "  # prefixes the one stdout line by which a run hands its figures back


def runtime_config(model: str, device: str, dtype: str, tokens: int) -> RuntimeConfig:
    return RuntimeConfig(model_path=model, device=device, dtype=dtype, decode_graphs="off",
                         cache=CacheConfig(page_size=16, max_total_tokens=tokens))


class Runner:
    """A runner of TP `size` (rank 0 here) on `threads` compute threads in all; closed on exit."""

    def __init__(self, cfg: RuntimeConfig, size: int, threads: int) -> None:
        self.ranks = None
        if size == 1:
            self.runner = ModelRunner(cfg)
            return
        cpus = [] if cfg.device.startswith("cuda") else cpu_sets(size, None)
        self.ranks = Ranks(cfg, Launch(size, cpus, 60.0, threads=max(1, threads // size)))
        mc = ModelConfig.from_dir(cfg.model_path)
        self.runner = ModelRunner(cfg, mc, tp=self.ranks.rank0(mc))

    def __enter__(self) -> ModelRunner:
        return self.runner

    def __exit__(self, *exc) -> None:
        if self.ranks is not None:
            self.runner.close()
            self.ranks.close()


def greedy(runner: ModelRunner, new_tokens: int) -> list[tuple[list[int], list[float]]]:
    engine = Engine(runner.config, Role.COLOCATED, runner)
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}

    def collect(out) -> None:
        tokens.setdefault(out.rid, []).extend(out.token_ids)
        lps.setdefault(out.rid, []).extend(lp.logprob for lp in out.logprobs)

    for i, ids in enumerate(PROMPTS):
        engine.add_request(Req(rid=str(i), input_ids=ids, on_output=collect, params=SamplingParams(
            temperature=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_logprob=True)))
    while engine.has_work():
        engine.step()
    return [(tokens[str(i)], lps[str(i)]) for i in range(len(PROMPTS))]


def step_ms(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    """Median wall time of a decode step of `batch` requests after a `prompt_len`-token prompt each."""
    alloc = PageAllocator(runner.pool.num_pages)
    page = runner.page_size
    reqs = []
    for i in range(batch):
        req = Req(rid=str(i), input_ids=[(7 * i + j) % 1000 + 5 for j in range(prompt_len)],
                  params=SamplingParams(temperature=0))
        req.pages = alloc.allocate(-(-(prompt_len + steps + 2) // page))
        reqs.append(req)
    for r in reqs:  # prefill one by one: the timed part is decode
        runner.forward(Batch([r], is_decode=False, extend_lens=[prompt_len]))
        r.num_computed = prompt_len
    times = []
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    for step in range(steps + 2):
        for r in reqs:
            r.output_ids.append(11 + step)
        sync()
        start = time.perf_counter()
        runner.forward(Batch(reqs, is_decode=True, extend_lens=[1] * batch))
        sync()
        times.append(time.perf_counter() - start)
        for r in reqs:
            r.num_computed += 1
    return statistics.median(times[2:]) * 1e3  # the first two warm up


def sizes(args: argparse.Namespace) -> tuple[int, int, int, tuple[int, ...]]:
    """(new greedy tokens, timed steps, prompt length, batches)."""
    return (8, 4, 32, (1, 4)) if args.dry_run else (32, 20, 128, (1, 64))


def run_arm(args: argparse.Namespace) -> dict:
    """One run in this process: the greedy answers or the step times of TP `args.size`."""
    new_tokens, steps, prompt_len, batches = sizes(args)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    tokens = max(batches) * (prompt_len + steps + 32) + 4096
    dtype = "float32" if args.arm == "greedy" else "bfloat16"
    with Runner(runtime_config(args.model_path, device, dtype, tokens), args.size, args.threads) as runner:
        if args.arm == "greedy":
            return {"answers": greedy(runner, new_tokens)}
        return {"step_ms": {str(b): step_ms(runner, b, prompt_len, steps) for b in batches}}


def arm(args: argparse.Namespace, kind: str, size: int) -> dict:
    """run_arm in a fresh interpreter with this run's flags (its log goes to stderr)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--model-path", args.model_path, "--device", args.device,
           "--tp-size", str(args.tp_size), "--threads", str(args.threads), "--arm", kind, "--size", str(size),
           *(["--dry-run"] if args.dry_run else [])]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the {kind} run of TP {size} failed (exit {out.returncode}): {' '.join(cmd)}")
    return json.loads(lines[-1][len(RESULT):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="step-time rounds (default: 4; 2 with --dry-run)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="compute threads of each run in all (default: %(default)s, every core here)")
    ap.add_argument("--dry-run", action="store_true", help="short runs: checks the script")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--arm", choices=("greedy", "steps"), help=argparse.SUPPRESS)  # one run, in its own process
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads < 1 or args.tp_size < 2 or (args.rounds is not None and args.rounds < 1):
        ap.error("--threads and --rounds take a positive number, --tp-size 2 or more")
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    if args.arm:
        print(RESULT + json.dumps(run_arm(args)), flush=True)
        return 0
    if args.device == "cuda" and torch.cuda.device_count() < args.tp_size:
        print(f"gpu_tp: --tp-size {args.tp_size} needs {args.tp_size} GPUs; this machine shows "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    rounds = args.rounds or (2 if args.dry_run else 4)
    n = args.tp_size
    batches = [str(b) for b in sizes(args)[3]]
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "tp_size": n, "threads": args.threads, "rounds": rounds}

    one, many = (arm(args, "greedy", size)["answers"] for size in (1, n))
    result["greedy_identical"] = all(a[0] == b[0] for a, b in zip(one, many))
    result["max_logprob_diff"] = max(abs(x - y) for a, b in zip(one, many) for x, y in zip(a[1], b[1]))
    print(f"greedy fp32, TP 1 vs TP {n}: identical {result['greedy_identical']}, "
          f"max |d logprob| {result['max_logprob_diff']:.2e}", flush=True)

    runs: dict[int, list[dict[str, float]]] = {1: [], n: []}
    started = time.monotonic()
    for r in range(rounds):
        for size in order([1, n], r):
            runs[size].append(arm(args, "steps", size)["step_ms"])
            print(f"round {r + 1} TP {size}: " + ", ".join(f"batch {b} {ms:.2f} ms"
                                                          for b, ms in runs[size][-1].items()), flush=True)
    series = {size: {b: [run[b] for run in found] for b in batches} for size, found in runs.items()}
    speedup = {b: Ratio.of(series[1][b], series[n][b]) for b in batches}
    result["step_ms"] = {f"tp{size}": {b: round(statistics.median(v), 3) for b, v in s.items()}
                         for size, s in series.items()}
    result["step_ms_rounds"] = {f"tp{size}": s for size, s in series.items()}
    result["tp1_over_tpn"] = {b: ratio.as_dict() for b, ratio in speedup.items()}
    print(f"\ndecode step, bf16, {rounds} rounds in rotating order, {args.threads} compute thread(s) per run, "
          f"{time.monotonic() - started:.0f} s; median (lowest-highest) over the rounds")
    print(f"{'batch':>6} {'TP 1 ms':>24} {f'TP {n} ms':>24}  TP 1 / TP {n}")
    for b in batches:
        print(f"{b:>6} {Spread.of(series[1][b]).text():>24} {Spread.of(series[n][b]).text():>24}  "
              f"{speedup[b].text()}")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
