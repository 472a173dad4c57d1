"""Multi-LoRA serving cost: 32 streams spread over 8 adapters against 32 streams on the base model, same server,
same run.

    .venv/bin/python benchmarks/bench_lora.py [--colocated] [--adapters 8] [--rank 16]
        [--targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj] [--concurrency 32]
        [--num-requests 64] [--output-len 128] [--up-args="..."] [--json FILE]

Makes `--adapters` seeded random PEFT adapters for the default model (PEFT's own save_pretrained; they are
random, so only their cost is measured, not their answers), starts `pdserve up` (PD, or colocated) with all of
them loaded (--max-loras-per-batch = their number), then runs the `pdserve bench` load twice on it: every
request on the base model, and request i on adapter i mod N. Prints both rows and the ratio of their output
tok/s (target >= 0.8), alternating the two loads over `--rounds` so the machine's drift hits both alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from servers import default_model_dir, pdserve_server, signals_deferred  # noqa: E402

from pdserve.benchclient import ErrorReporter, Load, Target, format_table, run_sweep  # noqa: E402

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def make_adapters(model_dir: Path, root: Path, count: int, rank: int, targets: list[str]) -> dict[str, Path]:
    from lora_adapters import make_peft_adapter

    return {f"adapter{i}": make_peft_adapter(model_dir, root / f"adapter{i}", rank=rank, target_modules=targets,
                                             alpha=2 * rank, seed=i, std=0.01) for i in range(count)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--colocated", action="store_true", help="one colocated worker instead of prefill + decode")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=ALL_TARGETS, help="comma-separated PEFT target modules")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=64, help="requests per load and round")
    ap.add_argument("--rounds", type=int, default=2, help="base and adapter loads alternate this many times")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--up-args", default="", help="extra flags for `pdserve up`, one string")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()

    model_dir = default_model_dir(None)
    model_name = model_dir.name
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-lora-") as tmp:
        work = Path(tmp)
        adapters = make_adapters(model_dir, work / "adapters", args.adapters, args.rank, args.targets.split(","))
        extra = ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items()),
                 "--max-loras-per-batch", str(args.adapters), *shlex.split(args.up_args)]
        server = pdserve_server("colocated" if args.colocated else "pd", model_dir, model_name, work, extra)
        print(f"[lora] {args.adapters} adapters, rank {args.rank}, targets {args.targets}; starting {server.name}: "
              f"{shlex.join(server.argv)}", flush=True)
        server.start()
        results: dict[str, list] = {"base": [], "adapters": []}
        try:
            print(f"[lora] ready after {server.wait_ready(args.startup_timeout):.0f} s", flush=True)
            target = Target(server.base_url, model_name)
            loads = {"base": Load(output_len=args.output_len, prompt_len=args.prompt_len),
                     "adapters": Load(output_len=args.output_len, prompt_len=args.prompt_len,
                                      models=tuple(adapters))}
            for round_ in range(args.rounds):
                for k, (name, load) in enumerate(loads.items()):
                    load = replace(load, seed=2 * round_ + k)  # fresh prompts: no run reuses another's prefixes
                    (summary,) = asyncio.run(run_sweep(target, load, [args.concurrency], args.num_requests,
                                                       args.concurrency if round_ == 0 else 0, ErrorReporter()))
                    print(f"[lora] round {round_ + 1} {name}: {summary.output_tok_s:.1f} tok/s, "
                          f"{summary.completed} ok, {summary.failed} failed", flush=True)
                    results[name].append(summary)
        finally:
            with signals_deferred():
                server.stop()
    rows = [(f"{name} r{i + 1}", s) for name, summaries in results.items() for i, s in enumerate(summaries)]
    print()
    print(format_table([s for _, s in rows], "load", [label for label, _ in rows]))
    base = sum(s.output_tok_s for s in results["base"])
    lora = sum(s.output_tok_s for s in results["adapters"])
    ratio = lora / base if base else float("nan")
    print(f"\n{server.name}: {args.adapters} adapters / base model output tok/s at {args.concurrency} streams: "
          f"{ratio:.2f} (target >= 0.8; mean of {args.rounds} alternating rounds each)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ratio": ratio, "server": server.name, "adapters": args.adapters,
                                               "rank": args.rank, "targets": args.targets,
                                               **{k: [vars(s) for s in v] for k, v in results.items()}}, indent=1))
    return 0 if results["base"] and results["adapters"] else 1


if __name__ == "__main__":
    sys.exit(main())
