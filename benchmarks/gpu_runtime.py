"""The runtime on a CUDA GPU (Triton kernels, decode graphs), against transformers on the same GPU.

    python benchmarks/gpu_runtime.py [--model-path DIR] [--json FILE]
    python benchmarks/gpu_runtime.py --save-model DIR [--tokenizer-files benchmarks/gpu_model_files]
    python benchmarks/gpu_runtime.py --device cpu --dry-run      # every part on a tiny model, no GPU

Without --model-path it builds a random-weight model of SmolLM2-135M's shape (no download needed);
--save-model writes that model next to real tokenizer files and stops (what gpu_check.sh serves). A run:
(1) greedy fp32 output of the runtime (graphs on, as served) identical to transformers' greedy `generate`;
(2) greedy bf16 output identical with decode graphs and overlapped steps on and off; (3) bf16 decode step
time at batch 1, 8, 32, 64 as served (graphs, overlapped steps), with graphs but each step read before the next
("serial"), and with neither, and where decode steps still make the host wait for the device; (4)
torch.profiler over 10 decode steps: GPU-busy fraction (CUDA kernel time over the step's wall time), kernels
and host launches per step; (5) the baseline to beat: transformers with a
static KV cache and torch.compile (CUDA graphs), ms per token at batch 1 and 64; (6) a raw device-to-device
copy's GB/s (the scale for the PD KV transfer); then the issue's runtime targets beside their figures.

--dry-run on the CPU runs the same code on a two-layer model with the static-buffer path uncaptured
(decode_graphs="static"), CPU-only profiling and transformers eager (torch.compile only on CUDA): it checks the
script, not the speed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_report import decode_targets, format_targets  # noqa: E402  (a sibling script, no torch)

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


@dataclass(frozen=True)
class Setup:
    device: str
    batches: tuple[int, ...]
    new_tokens: int  # tokens per request in the timed runs
    graphs: str  # decode_graphs with graphs on: "auto" captures on CUDA; "static" is that path uncaptured
    overlap: str  # overlap_schedule as served: "auto" is on for CUDA; "on" runs that order on the CPU
    max_total_tokens: int
    tiny: bool  # a two-layer model instead of SmolLM2-135M's shape


GPU = Setup("cuda", (1, 8, 32, 64), 64, "auto", "auto", 131072, tiny=False)
CPU_DRY = Setup("cpu", (1, 4), 6, "static", "on", 4096, tiny=True)


def sync(setup: Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- the model
def smollm_shaped(out_dir: str, tiny: bool = False, tokenizer_files: str | None = None) -> str:
    """Random weights of SmolLM2-135M's shape (or a two-layer one), saved in bf16 as the real model is.
    With `tokenizer_files`, the real tokenizer and config files go beside them, so a server can chat."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3)
    if tiny:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper than the default init, so greedy choices are not near-ties
        for p in model.parameters():
            p.mul_(4.0)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    if tokenizer_files:  # the real files' config.json has the same shape; the weights' own stays for tiny
        for name in TOKENIZER_FILES:
            if name != "config.json" or not tiny:
                shutil.copy(os.path.join(tokenizer_files, name), out_dir)
    return out_dir


# ---------------------------------------------------------------- the runtime
def engine_for(model_dir: str, dtype: str, setup: Setup, graphs: str, overlap: str = "off") -> Engine:
    return Engine(RuntimeConfig(model_path=model_dir, dtype=dtype, device=setup.device,
                                kernels="triton" if setup.device == "cuda" else "auto",
                                cache=CacheConfig(page_size=16, max_total_tokens=setup.max_total_tokens),
                                scheduler=SchedulerConfig(max_running_requests=256, max_prefill_tokens=16384),
                                decode_graphs=graphs, cuda_graph_max_bs=max(setup.batches), overlap_schedule=overlap))


def captured(engine: Engine) -> list[int]:
    graphs = engine.runner.graphs
    return sorted(graphs.graphs) if graphs is not None else []


def add(engine: Engine, prompts: list[list[int]], new_tokens: list[int], out: dict[str, list[int]] | None = None,
        prefix: str = "") -> None:
    for i, (ids, n) in enumerate(zip(prompts, new_tokens)):
        on_output = (lambda o: out.setdefault(o.rid, []).extend(o.token_ids)) if out is not None else None
        engine.add_request(Req(rid=f"{prefix}{i}", input_ids=ids, on_output=on_output,
                               params=SamplingParams(temperature=0, max_new_tokens=n, min_new_tokens=n)))


def run(engine: Engine, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    add(engine, prompts, new_tokens, out)
    while engine.has_work():
        engine.step()
    if not engine.scheduler.check_integrity().ok:
        raise RuntimeError("page accounting broken after the run")
    engine.flush_cache()
    return [out.get(str(i), []) for i in range(len(prompts))]


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    first_diff = [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else 0)
                  for a, b in zip(got, want)]
    return {"identical": sum(a == b for a, b in zip(got, want)), "of": len(want), "first_diff": first_diff}


def is_decoding(engine: Engine) -> bool:
    return not engine.scheduler.waiting and bool(engine.scheduler.running)


def decode_step_ms(engine: Engine, setup: Setup, batch: int) -> float:
    """Wall time per decode step of `batch` sequences (8-token prompts) over their whole decode, synchronised at
    its ends only: with overlapped steps the host prepares a step while the device runs the one before."""
    prompts = [[1, 500 + i, 42, 9, 17, 88, 11, 7] for i in range(batch)]
    run(engine, prompts, [4] * batch)  # warm-up: compiles and tunes this batch's kernels
    add(engine, prompts, [setup.new_tokens] * batch, prefix="s")
    while not is_decoding(engine):
        engine.step()
    sync(setup)
    t0, steps = time.perf_counter(), 0
    while is_decoding(engine):
        engine.step()
        steps += 1
    while engine.has_work():  # the last step's tokens, read
        engine.step()
    sync(setup)
    engine.flush_cache()
    return (time.perf_counter() - t0) / steps * 1e3


def sync_sites(engine: Engine, setup: Setup, batch: int, steps: int = 10) -> dict[str, float]:
    """Where decode steps make the host wait for the device (torch's sync debug mode), per step: each one stalls
    the host and so the overlap. Empty on a CPU (nothing to wait for)."""
    if setup.device != "cuda":
        return {}
    import warnings

    prompts = [[1, 900 + i, 42, 9, 17, 88, 11, 7] for i in range(batch)]
    add(engine, prompts, [steps + 8] * batch, prefix="y")
    while not is_decoding(engine) or len(engine.scheduler.running[0].output_ids) < 3:
        engine.step()
    sites: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
    while engine.has_work():
        engine.step()
    engine.flush_cache()
    return {site: n / steps for site, n in sites.most_common()}


# ---------------------------------------------------------------- the profile
@dataclass(frozen=True)
class StepProfile:
    steps: int
    kernels_per_step: float  # CUDA kernels executed (a graph replay counts each kernel in it)
    launches_per_step: float  # host calls that start GPU work: kernel launches and graph launches
    gpu_busy_ms_per_step: float  # summed CUDA kernel time
    copies_ms_per_step: float  # device memcpy / memset time, apart from the kernels
    host_ops_per_step: dict[str, float]  # the busiest torch ops on the host (the issue counted aten::mm, aten::empty)


def read_trace(trace: dict, steps: int) -> StepProfile:
    """Per-step figures from a torch.profiler Chrome trace (durations in microseconds)."""
    kernels = launches = 0
    kernel_us = copy_us = 0.0
    ops: Counter[str] = Counter()
    for ev in trace.get("traceEvents", []):
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if cat == "kernel":
            kernels += 1
            kernel_us += ev.get("dur", 0)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copy_us += ev.get("dur", 0)
        elif cat in ("cuda_runtime", "cuda_driver") and ("LaunchKernel" in name or "GraphLaunch" in name):
            launches += 1
        elif cat == "cpu_op":
            ops[name] += 1
    return StepProfile(steps, kernels / steps, launches / steps, kernel_us / steps / 1e3, copy_us / steps / 1e3,
                       {name: n / steps for name, n in ops.most_common(6)})


def profile_steps(engine: Engine, setup: Setup, batch: int, steps: int = 10) -> StepProfile:
    from torch.profiler import ProfilerActivity, profile

    prompts = [[1, 700 + i, 42, 9, 17, 88, 11, 7] for i in range(batch)]
    add(engine, prompts, [steps + 8] * batch, prefix="p")
    while not is_decoding(engine) or len(engine.scheduler.running[0].output_ids) < 3:  # prompts done, graphs warm
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device == "cuda" else [])
    sync(setup)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(setup)
    while engine.has_work():
        engine.step()
    engine.flush_cache()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return read_trace(json.load(open(f.name)), steps)


# ---------------------------------------------------------------- transformers, the baseline
def transformers_ms_per_token(model_dir: str, setup: Setup, batch: int) -> float:
    """Decode time per step of transformers with a static KV cache; on CUDA `generate` then compiles the decode
    forward with torch.compile (CompileConfig's default mode, "reduce-overhead": CUDA graphs). Each step's end
    is stamped from a stopping criterion (after a synchronise), so the prompt's forward is not counted."""
    from transformers import AutoModelForCausalLM, CompileConfig, StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            sync(setup)
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(setup.device).eval()
    ids = torch.tensor([[1, 500 + i, 42, 9, 17, 88, 11, 7] for i in range(batch)], device=setup.device)
    # dynamic=False: one static graph per batch size, as CUDA graphs want; fullgraph stays off (its default)
    kwargs = dict(max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens, do_sample=False, pad_token_id=2,
                  cache_implementation="static", compile_config=CompileConfig(dynamic=False))
    with torch.no_grad():
        for _ in range(2):  # the first call compiles and records the graphs; the second is timed
            clock = StepClock()
            hf.generate(ids, attention_mask=torch.ones_like(ids), stopping_criteria=StoppingCriteriaList([clock]),
                        **kwargs)
    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    del hf
    return statistics.median(gaps) * 1e3


def raw_copy_gbs(setup: Setup, mib: int = 256) -> float:
    """A device-to-device copy_ of `mib` MiB: what a KV transfer inside one GPU could reach at best."""
    n = mib * 2**20 // 2 if setup.device == "cuda" else 2**20
    src = torch.empty(n, dtype=torch.bfloat16, device=setup.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(setup)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(setup)
    return 10 * 2 * n / (time.perf_counter() - t0) / 1e9


# ---------------------------------------------------------------- the run
def greedy_checks(model_dir: str, setup: Setup, result: dict) -> None:
    from transformers import AutoModelForCausalLM

    n = 64 if setup.device == "cuda" else 8
    prompts = [[1] + [(37 * k + 11 * i) % 40000 + 50 for k in range(m)] for i, m in enumerate((7, 33, 90, 250))]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(setup.device).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([ids], device=setup.device), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=2)[0, len(ids):].tolist() for ids in prompts]
    del hf
    engine = engine_for(model_dir, "float32", setup, setup.graphs)
    result["greedy_fp32_transformers"] = compare(run(engine, prompts, [n] * 4), want)
    del engine
    print(f"greedy fp32, graphs on, 4 prompts x {n} tokens batched: "
          f"{result['greedy_fp32_transformers']['identical']}/4 identical to transformers "
          f"(first differing position per prompt: {result['greedy_fp32_transformers']['first_diff']})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="serve this model (default: SmolLM2-135M's shape, random)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="with --device cpu: a tiny model, to check the script")
    ap.add_argument("--save-model", metavar="DIR", default=None,
                    help="write the random SmolLM2-135M-shaped model to DIR and stop")
    ap.add_argument("--tokenizer-files", metavar="DIR",
                    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_model_files"),
                    help="real tokenizer/config files to put beside --save-model's weights (default: %(default)s)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args()
    if args.device == "cpu" and not args.dry_run:
        ap.error("--device cpu needs --dry-run: the figures mean something only on a GPU")
    if args.save_model:
        print(smollm_shaped(args.save_model, tiny=args.dry_run, tokenizer_files=args.tokenizer_files))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_runtime: torch.cuda.is_available() is false here; on a CPU use --device cpu --dry-run")
    setup = GPU if args.device == "cuda" else CPU_DRY
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    print(name, flush=True)
    result: dict = {"device": name, "dtype": "bfloat16", "batches": list(setup.batches)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_path or smollm_shaped(tmp, tiny=setup.tiny)
        greedy_checks(model_dir, setup, result)
        measure(model_dir, setup, result)
    print("targets (runtime):")
    print(format_targets(decode_targets(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def measure(model_dir: str, setup: Setup, result: dict) -> None:
    """Greedy bf16 with graphs on and off, step times, profiles, the transformers baseline, a raw copy."""
    count = 12 if setup.device == "cuda" else 5
    prompts = [[1] + [(13 * k + 7 * i) % 40000 + 50 for k in range(5 + 9 * i)] for i in range(count)]
    # Outputs of different lengths: the batch shrinks bucket by bucket as requests finish.
    new = [(16 + 8 * i) if setup.device == "cuda" else 4 + i for i in range(count)]
    decode_ms: dict[str, dict[str, float]] = {}
    profiles: dict[str, dict[str, dict]] = {}
    tokens = {}
    # "on": as served (graphs, overlapped steps); "serial": graphs, each step read before the next; "off": neither.
    for mode, graphs, overlap in (("on", setup.graphs, setup.overlap), ("serial", setup.graphs, "off"),
                                  ("off", "off", "off")):
        engine = engine_for(model_dir, "bfloat16", setup, graphs, overlap)
        if mode == "on":
            result["graphs_captured"] = captured(engine)
            print(f"decode graphs captured for batch sizes {result['graphs_captured'] or 'none (not on CUDA)'}")
        tokens[mode] = run(engine, prompts, new)
        decode_ms[mode] = {str(b): decode_step_ms(engine, setup, b) for b in setup.batches}
        if mode != "serial":
            profile_at = (1, max(setup.batches)) if mode == "on" else (max(setup.batches),)
            profiles[mode] = {str(b): asdict(profile_steps(engine, setup, b)) for b in profile_at}
            for b, p in profiles[mode].items():
                p["gpu_busy_fraction"] = p["gpu_busy_ms_per_step"] / decode_ms[mode][b]
        if mode == "on":
            result["sync_sites_per_step"] = {str(b): sync_sites(engine, setup, b) for b in (1, max(setup.batches))}
        del engine
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    result["greedy_bf16_graphs"] = compare(tokens["on"], tokens["off"])
    result["greedy_bf16_overlap"] = compare(tokens["on"], tokens["serial"])
    result["decode_ms"], result["profile"] = decode_ms, profiles
    for key, what in (("greedy_bf16_graphs", "graphs and overlap on and off"), ("greedy_bf16_overlap", "overlap on "
                                                                                                      "and off")):
        g = result[key]
        print(f"greedy bf16, {count} prompts of {len(prompts[0])}-{len(prompts[-1])} tokens, {new[0]}-{new[-1]} new: "
              f"{g['identical']}/{g['of']} identical with {what} (first differing position: {g['first_diff']})")
    for b, sites in result["sync_sites_per_step"].items():
        print(f"host waits for the device per overlapped decode step, batch {b}: "
              f"{sum(sites.values()):.1f} {sites if sites else ''}")
    hf_at = (1, max(setup.batches))
    result["transformers_compiled_ms"] = {str(b): transformers_ms_per_token(model_dir, setup, b) for b in hf_at}
    result["raw_d2d_copy_gbs"] = raw_copy_gbs(setup)
    print(f"{'batch':>5} {'served ms':>9} {'serial ms':>9} {'off ms':>7} {'tok/s':>9} {'hf+compile ms':>13} "
          f"{'vs hf':>6}")
    for b in map(str, setup.batches):
        on, off, hf = decode_ms["on"][b], decode_ms["off"][b], result["transformers_compiled_ms"].get(b)
        print(f"{b:>5} {on:>9.3f} {decode_ms['serial'][b]:>9.3f} {off:>7.3f} {int(b) / on * 1e3:>9.0f} "
              f"{'' if hf is None else f'{hf:.3f}':>13} {'' if hf is None else f'{hf / on:.2f}x':>6}")
    for mode, by_batch in profiles.items():
        for b, p in by_batch.items():
            print(f"profile, graphs {mode}, batch {b}: {p['kernels_per_step']:.0f} kernels and "
                  f"{p['launches_per_step']:.1f} host launches per step; GPU busy {p['gpu_busy_ms_per_step']:.3f} ms "
                  f"of {decode_ms[mode][b]:.3f} ({100 * p['gpu_busy_fraction']:.0f} %); copies "
                  f"{p['copies_ms_per_step']:.3f} ms; host ops per step {p['host_ops_per_step']}")
    print(f"raw device-to-device copy: {result['raw_d2d_copy_gbs']:.1f} GB/s")


if __name__ == "__main__":
    main()
