"""Structured output's cost: the same streaming chat load with and without a JSON schema, on one server, in one
run, and the grammar compile time (cold, and cached).

    .venv/bin/python benchmarks/bench_structured.py [--colocated] [--concurrency 32] [--num-requests 64]
        [--output-len 128] [--up-args="--threads 2"] [--json FILE]

`pdserve up` is started once on free loopback ports; the load alternates unconstrained and constrained rounds
(unconstrained, constrained, unconstrained, constrained) so that drifts in the machine's speed fall on both
alike, and the ratio is of the summed throughputs. The schema asks for a long list of records, so every request
still writes `--output-len` tokens (ignore_eos) and both loads produce the same number of tokens. Target:
constrained / unconstrained output tok/s >= 0.9.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from servers import default_model_dir, pdserve_server, signals_deferred

from pdserve.benchclient import ErrorReporter, Load, Target, run_sweep

SCHEMA = {"type": "array", "minItems": 500, "items": {
    "type": "object", "required": ["name", "age", "city"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "city": {"type": "string", "maxLength": 24}}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}


def compile_times(model_dir: Path, repeats: int = 5) -> dict[str, float]:
    """Seconds to compile SCHEMA the first time (tokenizer tables included, then without) and once cached."""
    from transformers import AutoTokenizer

    from pdserve.shared.grammar import Grammars
    from pdserve.shared.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    setup = time.perf_counter() - t0
    cold = []
    for k in range(repeats):  # a different schema each time: a cold compile, tokenizer tables already built
        schema = dict(SCHEMA, minItems=SCHEMA["minItems"] + k)
        t0 = time.perf_counter()
        grammars.compile(SamplingParams(json_schema=json.dumps(schema)))
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    grammars.compile(SamplingParams(json_schema=json.dumps(dict(SCHEMA, minItems=SCHEMA["minItems"]))))
    cached = time.perf_counter() - t0
    return {"tokenizer_tables_s": setup, "cold_compile_s": statistics.median(cold), "cached_compile_s": cached}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--colocated", action="store_true", help="one colocated worker (default: prefill + decode)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64, help="requests per round (4 rounds)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--up-args", default="", help="more `pdserve up` flags")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt))

    model_dir = default_model_dir(args.model_path)
    times = compile_times(model_dir)
    print(f"[structured] grammar compile: tokenizer tables {times['tokenizer_tables_s'] * 1e3:.0f} ms (once per "
          f"process), cold {times['cold_compile_s'] * 1e3:.1f} ms, cached {times['cached_compile_s'] * 1e3:.2f} ms",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-structured-"))
    mode = "colocated" if args.colocated else "pd"
    server = pdserve_server(mode, model_dir, model_dir.name, work, shlex.split(args.up_args))
    plain = Load(output_len=args.output_len)
    constrained = Load(output_len=args.output_len, extra_body=(("response_format", RESPONSE_FORMAT),))
    rounds: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    print(f"[structured] starting {server.name}: {shlex.join(server.argv)}", flush=True)
    server.start()
    try:
        server.wait_ready(args.startup_timeout)
        target = Target(server.base_url, model_dir.name)
        for name, load in [("unconstrained", plain), ("json_schema", constrained)] * 2:
            [summary] = asyncio.run(run_sweep(target, load, [args.concurrency], args.num_requests, 4,
                                              ErrorReporter()))
            if summary.failed:
                print(f"[structured] {summary.failed} {name} requests failed", flush=True)
                return 1
            rounds[name].append(summary.output_tok_s)
            print(f"[structured] {name}: {summary.output_tok_s:.1f} tok/s, TTFT p50 {summary.ttft_ms_p50:.0f} ms, "
                  f"ITL p50 {summary.itl_ms_p50:.1f} ms", flush=True)
    except KeyboardInterrupt:
        return 130
    finally:
        with signals_deferred():
            server.stop()
    ratio = sum(rounds["json_schema"]) / sum(rounds["unconstrained"])
    verdict = "met" if ratio >= 0.9 else "missed"
    print(f"\n{server.name}, {args.concurrency} streams, {args.output_len} tokens each:\n"
          f"  unconstrained  {statistics.mean(rounds['unconstrained']):7.1f} tok/s\n"
          f"  json_schema    {statistics.mean(rounds['json_schema']):7.1f} tok/s\n"
          f"  ratio          {ratio:7.2f}   target >= 0.9   {verdict}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"server": server.name, "rounds": rounds, "ratio": ratio,
                                               "compile": times}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
