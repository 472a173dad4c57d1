"""Speculative decoding (`--speculative-algorithm ngram`) against the same server without it and against vLLM's
CPU server, on two workloads, one server at a time on this machine.

    .venv/bin/python benchmarks/bench_speculative.py [--servers plain,spec,pd,pd-spec,vllm] [--concurrency 1,32]
        [--output-len 128] [--prompt-len 160] [--num-requests N] [--warmup 4] [--vllm-venv /work/vllm-venv]
        [--spec-args="--speculative-num-draft-tokens 6"] [--json FILE]

Workloads (`pdserve bench --workload`): copy, a passage of prose and code lines with an instruction to repeat it
(the answer quotes its prompt, as edits of code, extraction and answers citing their sources do), and chat, the
serving benchmark's prompts of seeded words. Every request streams `output_len` tokens (ignore_eos), greedy.
Servers: plain (`pdserve up --colocated`), spec (the same with ngram speculation), pd and pd-spec (`pdserve up`,
one prefill and one decode worker), vllm (`vllm serve`, benchmarks/setup_vllm_cpu.sh). Each server runs both
workloads, then stops before the next starts. The accept length and rate of each level come from the decode
workers' totals, read through the gateway's /get_server_info before and after it.

Targets:
    copy, 1 stream:   spec/plain output tok/s >= 1.8, and spec/vLLM ITL p50 <= 0.5
    copy, 32 streams: spec/plain output tok/s >= 1.2
    chat, 1 and 32:   spec/plain output tok/s >= 0.97 (drafting backs off where it does not pay)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import sys
import tempfile
import urllib.request
from dataclasses import asdict
from pathlib import Path

import bench_serving as serving
import servers
from pdserve.benchclient import ErrorReporter, Load, Target, parse_concurrencies, run_sweep

SERVERS = ("plain", "spec", "pd", "pd-spec", "vllm")
WORKLOADS = ("copy", "chat")
SPEC_FLAGS = ["--speculative-algorithm", "ngram"]


def build(name: str, args: argparse.Namespace, model_dir: Path, model_name: str, work: Path) -> servers.Server | None:
    if name == "vllm":
        venv = Path(args.vllm_venv)
        if not (venv / "bin" / "vllm").exists():
            print(servers.VLLM_SETUP_HINT.format(venv=venv), flush=True)
            return None
        return servers.vllm_server(venv, model_dir, model_name, work, shlex.split(args.vllm_args))
    extra = shlex.split(args.up_args) + (SPEC_FLAGS + shlex.split(args.spec_args) if name.endswith("spec") else [])
    mode = "pd" if name.startswith("pd") else "colocated"
    server = servers.pdserve_server(mode, model_dir, model_name, work / name, extra)
    server.name = name
    return server


def spec_totals(server: servers.Server) -> tuple[int, int, int] | None:
    """(drafting requests, draft tokens, accepted) summed over the server's decoding workers; None for vLLM."""
    if server.name == "vllm":
        return None
    url = server.base_url.removesuffix("/v1") + "/get_server_info"
    with urllib.request.urlopen(url, timeout=30) as reply:
        workers = json.load(reply)["workers"]
    totals = [w["speculative"] for w in workers if w.get("speculative")]
    return tuple(sum(t[k] for t in totals) for k in ("drafting_reqs", "draft_tokens", "accepted_tokens"))


def measure(server: servers.Server, args: argparse.Namespace, model_name: str, concurrencies: list[int]
            ) -> dict[str, list[dict]]:
    print(f"[spec] starting {server.name}: {shlex.join(server.argv)}", flush=True)
    server.start()
    try:
        print(f"[spec] {server.name} ready after {server.wait_ready(args.startup_timeout):.0f} s", flush=True)
        target = Target(server.base_url, model_name)
        out: dict[str, list[dict]] = {}
        for workload in WORKLOADS:
            load = Load(output_len=args.output_len, prompt_len=args.prompt_len, workload=workload)
            marks: list[tuple[int, int, int] | None] = []

            def level_starts(concurrency: int, count: int):
                marks.append(spec_totals(server))
                return None

            summaries = asyncio.run(run_sweep(target, load, concurrencies, args.num_requests, args.warmup,
                                              ErrorReporter(), None, level_starts))
            marks.append(spec_totals(server))
            rows = []
            for i, s in enumerate(summaries):
                row = asdict(s)
                if marks[i] is not None and marks[i + 1] is not None:
                    reqs, drafted, accepted = (b - a for a, b in zip(marks[i], marks[i + 1]))
                    row["accept_length"] = 1 + accepted / reqs if reqs else None
                    row["accept_rate"] = accepted / drafted if drafted else None
                rows.append(row)
                print(f"[spec] {server.name} {workload} x{s.concurrency}: {s.output_tok_s:.1f} tok/s, ITL p50 "
                      f"{s.itl_ms_p50 or 0:.1f} ms, accept length {row.get('accept_length') or '-'}, "
                      f"{s.completed} ok, {s.failed} failed", flush=True)
            out[workload] = rows
        return out
    finally:
        with servers.signals_deferred():
            server.stop()


def ratio(results: dict, a: str, b: str, workload: str, concurrency: int, metric: str) -> float | None:
    def value(name: str):
        rows = results.get(name, {}).get(workload, [])
        return next((r[metric] for r in rows if r["concurrency"] == concurrency), None)

    x, y = value(a), value(b)
    return x / y if x is not None and y else None


def targets(results: dict, low: int, high: int) -> list[serving.Ratio]:
    """The issue's targets at the levels measured: copy's at one stream (1.8x, ITL) and at the highest level above
    one (1.2x), chat's and PD's at each level once."""
    Ratio = serving.Ratio
    levels = sorted({low, high})
    out = []
    if low == 1:
        out += [Ratio("copy x1: spec/plain output tok/s", ratio(results, "spec", "plain", "copy", 1, "output_tok_s"),
                      1.8, True),
                Ratio("copy x1: spec/vLLM ITL p50", ratio(results, "spec", "vllm", "copy", 1, "itl_ms_p50"),
                      0.5, False)]
    if high > 1:
        out.append(Ratio(f"copy x{high}: spec/plain output tok/s",
                         ratio(results, "spec", "plain", "copy", high, "output_tok_s"), 1.2, True))
    for c in levels:
        out.append(Ratio(f"chat x{c}: spec/plain output tok/s",
                         ratio(results, "spec", "plain", "chat", c, "output_tok_s"), 0.97, True))
    for workload in WORKLOADS:  # PD, reported beside
        for c in levels:
            out.append(Ratio(f"{workload} x{c}: pd-spec/pd output tok/s",
                             ratio(results, "pd-spec", "pd", workload, c, "output_tok_s"), 1.0, True))
    return out


def print_table(results: dict) -> None:
    print(f"\n{'server':<9} {'workload':<8} {'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8} "
          f"{'accept len':>10} {'rate':>6}")
    for name, by_workload in results.items():
        for workload, rows in by_workload.items():
            for r in rows:
                length, rate = r.get("accept_length"), r.get("accept_rate")
                print(f"{name:<9} {workload:<8} {r['concurrency']:>7} {r['output_tok_s']:>8.1f} "
                      f"{r['ttft_ms_p50'] or 0:>7.0f}ms {r['itl_ms_p50'] or 0:>6.1f}ms "
                      f"{'-' if length is None else f'{length:.2f}':>10} {'-' if rate is None else f'{rate:.2f}':>6}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--concurrency", action="append", default=[], metavar="N[,N...]")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--vllm-venv", default="/work/vllm-venv")
    parser.add_argument("--vllm-args", default="")
    parser.add_argument("--up-args", default="", help="extra flags for every `pdserve up`")
    parser.add_argument("--spec-args", default="", help="extra flags for the speculating servers")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    concurrencies = parse_concurrencies(args.concurrency or ["1,32"])
    names = [n for n in args.servers.split(",") if n]
    if not names or any(n not in SERVERS for n in names):
        raise SystemExit(f"--servers takes a list of {', '.join(SERVERS)}")
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-spec-"))
    results: dict[str, dict[str, list[dict]]] = {}
    try:
        model_dir = servers.default_model_dir(args.model_path)
        model_name = model_dir.name
        for name in names:
            server = build(name, args, model_dir, model_name, work)
            if server is None:
                continue
            try:
                results[name] = measure(server, args, model_name, concurrencies)
            except RuntimeError as exc:
                print(f"[spec] {name} skipped: {exc}\n{server.log_tail()}", flush=True)
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    found = targets(results, min(concurrencies), max(concurrencies))
    print("\nratios:")
    for r in found:
        print(r.line())
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratios": [asdict(r) | {"verdict": r.verdict()}
                                                                               for r in found]}, indent=2))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
