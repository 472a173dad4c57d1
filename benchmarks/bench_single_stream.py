"""One stream's decode step against the memory floor, broken down, and what serving adds on top of it.

    .venv/bin/python benchmarks/bench_single_stream.py [--rounds 3] [--tokens 96] [--threads 2]
        [--quantizations none,w8a8_int8] [--before REV] [--after REV] [--parts step,worker,served]

For the default model at batch 1, each of bf16 and `w8a8_int8`, and each tree (this checkout or `--after REV`, and
`--before REV` laid out beside it, e.g. the commit before a suspected regression), every round runs, in processes of their own,
in an order that rotates from round to round (benchmarks/arms.py):
- step: the engine stepping one greedy request in-process; first the plain step (wall time of `Engine.step`), then
  the same steps with timers around the model's calls, which split it into the dense layers' matmuls, the LM head,
  decode attention, norms + rotary + activation, the rest of the forward (Python, embedding, residual adds), the
  sampler and the engine's own work around the forward (scheduling, outputs). The same process measures this
  machine's read bandwidth (the best of torch sums over 512 MiB, in 4 KiB and in 2 MiB pages) and prints the memory
  floor: the bytes of weights one token reads (every layer's and the LM head's, at their stored width) over it;
- worker: a colocated worker (`pdserve colocated`) streamed over gRPC on loopback: what the engine process's hop to
  the worker's front adds to the step;
- served: `pdserve up --colocated` (gateway, jobs, worker) streamed over HTTP by pdserve's bench client: what the
  gateway adds on top of the worker.
Prints each round, then medians (lowest-highest) over the rounds, with the load average at the start and the end
(the machine is shared: read the ratios of arms measured side by side). Targets checked for this checkout:
the step within 1.15x the floor; the served 1-stream ITL at most the step + 1 ms; int8's step at most bf16's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from arms import Spread, order  # noqa: E402
from servers import default_model_dir, layout, pdserve_server, signals_deferred  # noqa: E402

# Runs in a process of its own, with the tree under test first on its path: only names every tree has.
STEP = r"""
import json, statistics, sys, time
import torch
tokens, quant, threads = int(sys.argv[1]), sys.argv[2] or None, int(sys.argv[3])
torch.set_num_threads(threads)
torch.set_num_interop_threads(1)
from pdserve.shared import linear as linear_mod, sampler as sampler_mod
from pdserve.shared.config import RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_files import resolve_model_path
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
engine = Engine(RuntimeConfig(model_path=str(resolve_model_path(None)), quantization=quant,
                              scheduler=SchedulerConfig(max_running_requests=8)))
model = engine.runner.model
acc = {}
clock = time.thread_time if threads == 1 else time.perf_counter  # one thread: its CPU time, robust to a busy host

def run(rid, timed):
    walls, forwards = [], []
    req = Req(rid=rid, input_ids=list(range(100, 164)),
              params=SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True))
    engine.add_request(req)
    while engine.has_work():
        acc.clear()
        t0 = clock()
        engine.step()
        walls.append(clock() - t0)
        forwards.append(acc.get("forward", 0.0))
        if timed:
            for key in ("dense", "lm_head", "attention", "norms_rotary_act", "sampler"):
                parts.setdefault(key, []).append(acc.get(key, 0.0))
    return walls[8:], forwards[8:]  # the prefill and the first steps warm up

def timer(key, fn, pick=None):
    def wrapped(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            k = pick(args) if pick else key
            acc[k] = acc.get(k, 0.0) + clock() - t0
    return wrapped

engine.runner.forward = timer("forward", engine.runner.forward)
run("warm", False)
walls, forwards = run("plain", False)
parts = {}
classes = [linear_mod.Linear]
try:
    from pdserve.shared.int8_linear import Int8Linear
    classes.append(Int8Linear)
except ImportError:
    pass
for cls in classes:
    cls.__call__ = timer(None, cls.__call__, lambda a: "lm_head" if a[0] is model.lm_head else "dense")
ops = engine.runner.ops
for name, key in (("decode_attention", "attention"), ("plan_decode", "attention"), ("rmsnorm", "norms_rotary_act"),
                  ("rotary_store_kv", "norms_rotary_act"), ("silu_and_mul", "norms_rotary_act")):
    if hasattr(ops, name):
        object.__setattr__(ops, name, timer(key, getattr(ops, name)))
sampler_mod.Sampler.sample = timer("sampler", sampler_mod.Sampler.sample)
t_walls, t_forwards = run("timed", True)
x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MiB, in 4 KiB pages and, where the tree can, in 2 MiB ones
try:
    from pdserve.shared.huge_pages import place
    buffers = [x, place(x)]
except ImportError:
    buffers = [x]
best = min((lambda t0: (y.sum(), clock() - t0)[1])(clock()) for y in buffers for _ in range(6))
weights = sum(lin.nbytes for layer in model.layers for lin in layer.linears()) + model.lm_head.nbytes
med = statistics.median
out = {"step": med(walls), "forward": med(forwards), "timed_step": med(t_walls), "timed_forward": med(t_forwards),
       "bandwidth": x.numel() * 4 / best, "weight_bytes": weights,
       "lm_head_bytes": model.lm_head.nbytes, "lm_head_kind": type(model.lm_head).__name__}
out.update({k: med(v) for k, v in parts.items()})
print(json.dumps(out))
"""


def step_arm(tree: Path | None, quant: str, args: argparse.Namespace, cwd: Path) -> dict:
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree else {})}
    out = subprocess.run([sys.executable, "-c", STEP, str(args.tokens), quant, str(args.threads)],
                         capture_output=True, text=True, env=env, cwd=cwd)
    if out.returncode:
        raise RuntimeError(f"step arm failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker_arm(tree: Path | None, quant: str, args: argparse.Namespace) -> float:
    """1-stream inter-token gap p50 (ms) of a colocated worker streamed over gRPC."""
    import grpc
    from bench_engine_process import start
    from bench_worker_streams import stream

    from pdserve.proto import worker_pb2_grpc as pb_grpc
    extra = ["--threads", str(args.threads), *(["--quantization", quant] if quant else [])]
    proc, addr = start("worker", str(tree) if tree else None, extra)
    try:
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.WorkerStub(ch)
            stream(stub, "warm", 16)
            times = stream(stub, "one", args.tokens)
        return statistics.median(b - a for a, b in zip(times[1:], times[2:])) * 1000
    finally:
        proc.stop()


def served_arm(tree: Path | None, quant: str, args: argparse.Namespace, work: Path) -> float:
    """1-stream ITL p50 (ms) of `pdserve up --colocated` streamed over HTTP (chat, pdserve's bench client)."""
    from pdserve.benchclient import ErrorReporter, Load, Target, run_sweep
    model_dir = default_model_dir(None)
    name = "colocated-int8" if quant else "colocated"
    server = pdserve_server(name, model_dir, model_dir.name, work, ["--threads", str(args.threads)], tree)
    server.start()
    try:
        server.wait_ready(600)
        load = Load(output_len=args.tokens, prompt_len=40)
        summary = asyncio.run(run_sweep(Target(server.base_url, model_dir.name), load, [1], 3, 1, ErrorReporter(),
                                        lambda s: None))
        return summary[0].itl_ms_p50
    finally:
        with signals_deferred():
            server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96, help="output tokens of the measured stream")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--quantizations", default="none,w8a8_int8")
    ap.add_argument("--before", default="", metavar="REV", help="also measure the tree at this commit")
    ap.add_argument("--after", default="", metavar="REV",
                    help="measure this commit instead of the working tree (which may change while this runs)")
    ap.add_argument("--parts", default="step,worker,served")
    args = ap.parse_args()
    quants = ["" if q == "none" else q for q in args.quantizations.split(",")]
    parts = args.parts.split(",")
    load0, started = os.getloadavg(), time.monotonic()
    step: dict[tuple, list[dict]] = {}
    gaps: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-single-stream-") as tmp:
        trees: dict[str, Path | None] = {}
        for rev in (args.before, args.after):
            if rev:
                (Path(tmp) / rev).mkdir()
                trees[f"@{rev}"] = layout(rev, Path(tmp) / rev)
        if not args.after:
            trees["now"] = None
        # Run from here: from the checkout, `python -m pdserve` and `-c` would find its package before PYTHONPATH.
        os.chdir(tmp)
        arms = [(t, q, p) for t in trees for q in quants for p in parts]
        for r in range(args.rounds):
            for tree, quant, part in order(arms, r):
                key, label = (tree, quant), f"{tree} {quant or 'bf16'}"
                path = trees[tree]
                if part == "step":
                    res = step_arm(path, quant, args, Path(tmp))
                    step.setdefault(key, []).append(res)
                    print(f"round {r + 1} {label:>22} step {res['step'] * 1e3:6.2f} ms (forward "
                          f"{res['forward'] * 1e3:.2f}), floor {res['weight_bytes'] / res['bandwidth'] * 1e3:.2f} ms",
                          flush=True)
                else:
                    gap = (worker_arm(path, quant, args) if part == "worker"
                           else served_arm(path, quant, args, Path(tmp)))
                    gaps.setdefault((*key, part), []).append(gap)
                    print(f"round {r + 1} {label:>22} {part} ITL p50 {gap:6.2f} ms", flush=True)
    report(step, gaps, trees, quants, args, load0, time.monotonic() - started)
    return 0


def report(step, gaps, trees, quants, args, load0, seconds) -> None:
    print(f"\n{args.rounds} rounds, {args.threads} threads, {seconds:.0f} s; load average "
          f"{load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; ms, median (lowest-highest)")
    rows = [("floor (weights / read bandwidth)", lambda s: s["weight_bytes"] / s["bandwidth"]),
            ("decode step", lambda s: s["step"]), ("  forward", lambda s: s["forward"]),
            ("  step with timers", lambda s: s["timed_step"]),
            ("    dense layers' matmuls", lambda s: s["dense"]), ("    LM head", lambda s: s["lm_head"]),
            ("    attention", lambda s: s["attention"]), ("    norms, rotary, activation", lambda s: s["norms_rotary_act"]),
            ("    rest of the forward", lambda s: s["timed_forward"] - s["dense"] - s["lm_head"] - s["attention"]
             - s["norms_rotary_act"]),
            ("    sampler", lambda s: s["sampler"]),
            ("    engine around the forward", lambda s: s["timed_step"] - s["timed_forward"] - s["sampler"])]
    cols = [(t, q) for t in trees for q in quants]
    print(f"{'':34}" + "".join(f"{t + ' ' + (q or 'bf16'):>26}" for t, q in cols))
    for name, fn in rows:
        cells = [Spread.of([fn(s) * 1e3 for s in step[c]]).text() if c in step else "-" for c in cols]
        print(f"{name:34}" + "".join(f"{c:>26}" for c in cells))
    for part, name in (("worker", "worker 1-stream ITL (gRPC)"), ("served", "served 1-stream ITL (HTTP)")):
        cells = [Spread.of(gaps[(*c, part)]).text() if (*c, part) in gaps else "-" for c in cols]
        print(f"{name:34}" + "".join(f"{c:>26}" for c in cells))
    for c in cols:
        if c in step:
            s = step[c][0]
            print(f"{c[0]} {c[1] or 'bf16'}: weights {s['weight_bytes'] / 1e6:.0f} MB a token (LM head "
                  f"{s['lm_head_bytes'] / 1e6:.0f} MB, {s['lm_head_kind']}); read bandwidth "
                  f"{statistics.median(x['bandwidth'] for x in step[c]) / 1e9:.1f} GB/s")
    for q in quants:
        c = (list(trees)[-1], q)
        if c not in step:
            continue
        st = statistics.median(s["step"] for s in step[c]) * 1e3
        fl = statistics.median(s["weight_bytes"] / s["bandwidth"] for s in step[c]) * 1e3
        print(f"target {q or 'bf16'}: step <= 1.15x floor: {st:.2f} / {fl:.2f} = {st / fl:.2f}x")
        if (*c, "served") in gaps:
            sv = statistics.median(gaps[(*c, "served")])
            print(f"target {q or 'bf16'}: served ITL <= step + 1 ms: {sv:.2f} vs {st + 1:.2f}")
    now = list(trees)[-1]
    if (now, "") in step and (now, "w8a8_int8") in step:
        b, i = (statistics.median(s["step"] for s in step[(now, q)]) * 1e3 for q in ("", "w8a8_int8"))
        print(f"target: int8 step <= bf16 step: {i:.2f} vs {b:.2f}")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")


if __name__ == "__main__":
    sys.exit(main())
