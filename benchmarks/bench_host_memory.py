"""The CPU runtime with glibc keeping freed memory (what it does) against glibc's default, in one run.

    .venv/bin/python benchmarks/bench_host_memory.py [--requests 48] [--threads 2]

Runs the same mixed workload twice, each in a fresh process: requests with prompts of 32 to 1,200
tokens and 8 to 64 new tokens, batched and chunk-prefilled together, so that every step allocates
differently sized activations and KV gathers. Prints wall time and page faults of each and the ratio.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

WORKLOAD = r"""
import json, random, resource, sys, time
import torch
import pdserve.shared.model_runner as model_runner
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

mode, requests, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "default":
    model_runner.keep_freed_memory = lambda: False  # leave glibc as it comes
torch.set_num_threads(threads)
engine = Engine(RuntimeConfig(model_path=str(resolve_model_path(None)), dtype="bfloat16",
                              cache=CacheConfig(page_size=16, max_total_tokens=65536),
                              scheduler=SchedulerConfig(max_running_requests=64, chunked_prefill_size=512,
                                                        max_prefill_tokens=4096)))
rng = random.Random(0)
for i in range(requests):
    length = rng.choice([32, 100, 300, 700, 1200])
    engine.add_request(Req(rid=f"r{i}", input_ids=[(13 * k + i) % 40000 + 100 for k in range(length)],
                           params=SamplingParams(temperature=0, max_new_tokens=rng.randint(8, 64), ignore_eos=True)))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
start = time.perf_counter()
steps = 0
while engine.has_work():
    engine.step()
    steps += 1
print(json.dumps({"seconds": time.perf_counter() - start, "steps": steps,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}))
"""


def run(mode: str, requests: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKLOAD, mode, str(requests), str(threads)],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    results = {mode: run(mode, args.requests, args.threads) for mode in ("default", "kept")}
    for mode, r in results.items():
        print(f"{mode:>8}: {r['seconds']:.2f} s for {r['steps']} steps, {r['faults']:,} page faults")
    print(f"kept / default time: {results['kept']['seconds'] / results['default']['seconds']:.2f}")


if __name__ == "__main__":
    main()
