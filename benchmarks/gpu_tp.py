"""Tensor parallelism on several devices: greedy output of TP 1 and TP N, and decode step times at batch 1 and 64.

    python benchmarks/gpu_tp.py --model-path DIR [--tp-size 2] [--json FILE]     # on a machine with >= 2 GPUs
    python benchmarks/gpu_tp.py --model-path DIR --device cpu --dry-run          # the script's plumbing, on CPU

(1) Greedy fp32 tokens of a few prompts, TP 1 (one device) against TP N (rank r on device r, NCCL between
them), through the engine with every prompt batched: identical, and the largest logprob difference. (2) bf16
decode step time at batch 1 and 64 (prompts of 128 tokens prefilled first), median of the timed steps, TP 1
and TP N, and their ratio. The model is whatever --model-path holds (gpu_check.sh: SmolLM2-135M's shape with
random weights, whose 3 KV-head groups split 2 + 1 over two ranks). On the CPU (--device cpu) the ranks run on
their own cores with the shared-memory all-reduce; --dry-run shortens every part: it checks the script.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from pdserve.shared.config import CacheConfig, ModelConfig, Role, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch
from pdserve.shared.tp_ranks import Launch, Ranks, cpu_sets

PROMPTS = [[1, 520, 33, 900, 12, 7, 4410, 88, 301], [1, 2, 3, 4, 5], list(range(100, 160))]


def runtime_config(model: str, device: str, dtype: str, tokens: int) -> RuntimeConfig:
    return RuntimeConfig(model_path=model, device=device, dtype=dtype, decode_graphs="off",
                         cache=CacheConfig(page_size=16, max_total_tokens=tokens))


class Runner:
    """A runner of TP `size` (rank 0 here); closed on exit."""

    def __init__(self, cfg: RuntimeConfig, size: int) -> None:
        self.ranks = None
        if size == 1:
            self.runner = ModelRunner(cfg)
            return
        cpus = [] if cfg.device.startswith("cuda") else cpu_sets(size, None)
        affinity = os.sched_getaffinity(0)
        self.ranks = Ranks(cfg, Launch(size, cpus, 60.0))
        mc = ModelConfig.from_dir(cfg.model_path)
        self.runner = ModelRunner(cfg, mc, tp=self.ranks.rank0(mc))
        self.affinity = affinity

    def __enter__(self) -> ModelRunner:
        return self.runner

    def __exit__(self, *exc) -> None:
        if self.ranks is not None:
            self.runner.close()
            self.ranks.close()
            os.sched_setaffinity(0, self.affinity)  # the next runner gets every core again


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="short runs: checks the script")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp_size:
        print(f"gpu_tp: --tp-size {args.tp_size} needs {args.tp_size} GPUs; this machine shows "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    device = "cuda:0" if args.device == "cuda" else "cpu"
    new_tokens, steps, prompt_len = (8, 4, 32) if args.dry_run else (32, 20, 128)
    batches = (1, 4) if args.dry_run else (1, 64)
    tokens = max(batches) * (prompt_len + steps + 32) + 4096
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "tp_size": args.tp_size}

    answers = {}
    for size in (1, args.tp_size):
        with Runner(runtime_config(args.model_path, device, "float32", tokens), size) as runner:
            answers[size] = greedy(runner, new_tokens)
    one, many = answers[1], answers[args.tp_size]
    result["greedy_identical"] = all(a[0] == b[0] for a, b in zip(one, many))
    result["max_logprob_diff"] = max(abs(x - y) for a, b in zip(one, many) for x, y in zip(a[1], b[1]))
    print(f"greedy fp32, TP 1 vs TP {args.tp_size}: identical {result['greedy_identical']}, "
          f"max |d logprob| {result['max_logprob_diff']:.2e}")

    times: dict[int, dict[int, float]] = {}
    for size in (1, args.tp_size):
        with Runner(runtime_config(args.model_path, device, "bfloat16", tokens), size) as runner:
            times[size] = {b: step_ms(runner, b, prompt_len, steps) for b in batches}
    result["step_ms"] = {f"tp{size}": {str(b): round(ms, 3) for b, ms in t.items()} for size, t in times.items()}
    print(f"{'batch':>6} {'TP 1 ms':>9} {f'TP {args.tp_size} ms':>9} {'TP1/TPN':>8}")
    for b in batches:
        a, n = times[1][b], times[args.tp_size][b]
        print(f"{b:>6} {a:>9.3f} {n:>9.3f} {a / n:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
