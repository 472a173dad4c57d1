"""Tensor parallelism on a CPU: the all-reduce a tensor-parallel step is made of, then a worker split over 2 ranks
against the same worker in one process, served over HTTP, each beside its baseline measured in the same run.

    .venv/bin/python benchmarks/bench_tp.py [--parts collectives,served] [--rounds 2] [--concurrency 1,32]
        [--requests N] [--warmup 4] [--output-len 128] [--prompt-len 40] [--ar-iters 500] [--ar-blocks 5] [--up-args="..."]
        [--model-path DIR] [--json FILE] [--keep-logs]

collectives  an all-reduce (sum) between two processes, each pinned to a core of its own with one torch thread,
             of a [1, 576] and a [32, 576] tensor (the default model's hidden size: one decode step's partial sums,
             and 32 streams') in fp32 and bf16: torch.distributed's gloo (init_process_group("gloo") over
             tcp://127.0.0.1) against pdserve's shared-memory ShmGroup (shared/tp_group.py: the benchmark creates
             the Mailbox, both ranks attach to it), the one tensor-parallel workers use on CPUs. Each is first
             checked to sum (1 + 2 = 3 on both ranks), then timed in-place on rank 0: --ar-blocks blocks of
             --ar-iters calls after a warm-up; the median block's microseconds per call, and gloo/shm.
served       `pdserve up --colocated` (TP 1: one worker process computing on every core) against
             `pdserve up --colocated --tp-size 2` (rank 0 in the worker, rank 1 a process it starts, each pinned to
             its own cores), the default model, one server at a time (servers.py: free loopback ports, a temporary
             --state-dir), --rounds rounds of one server of each, their order rotating from round to round (TP 1
             first, then TP 2 first: benchmarks/arms.py), every server a fresh `pdserve up` with the same flags
             but --tp-size: the load of bench_serving.py (`pdserve bench`'s: a warm-up, then each concurrency
             level, 4 x concurrency requests by default, streamed chat completions of --output-len tokens with
             ignore_eos, ~40-token distinct prompts, greedy), then one greedy chat request ("What is the capital of
             France?", temperature 0, max_tokens 32). Prints each server's table (tok/s, TTFT, ITL); output tok/s
             and TTFT p50 at the highest concurrency and ITL p50 at the lowest, each as the median and spread
             over the rounds and TP2/TP1 as the quotient of the medians and the range of the per-round
             quotients; and whether every server gave the same greedy text (a bf16 model may round differently when its sums are split:
             reported, not required).

No targets: the figures are this machine's. The default size takes about 3-4 minutes on a 2-core machine when
nothing else runs there (8-10 beside other work). The last line says how many cores other processes kept busy during each
measurement (the machine's busy time in /proc/stat less this benchmark's and its servers'): ranks pinned to a core
each, which meet in every layer, suffer most from a busy neighbour, so figures taken beside more than 0.1 of a core
are flagged. Servers, rank processes and whatever they started are stopped on exit, Ctrl-C and errors included.
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
import time
from dataclasses import asdict, dataclass

import servers
from arms import Ratio, Spread, order
from pathlib import Path

from bench_serving import level
from kv_tiers_load import Answer, ask_all
from pdserve.benchclient import (ErrorReporter, LevelSummary, Load, Target, format_errors, format_table,
                                 parse_concurrencies, run_sweep)
from tp_collectives import (DTYPES, SHAPES, Collective, Elsewhere, collective_ratio, print_collectives, run_collectives,
                            say)

PARTS = ("collectives", "served")
GREEDY_PROMPT = "What is the capital of France?"
GREEDY_TOKENS = 32
BUSY_ELSEWHERE = 0.1  # cores other processes may keep busy before the figures are flagged as disturbed
SERVED = (("tp1", []), ("tp2", ["--tp-size", "2"]))  # (label, extra `pdserve up --colocated` flags)


# ---------------------------------------------------------------- served


@dataclass
class Served:
    label: str
    command: str
    ready_s: float
    summaries: list[LevelSummary]
    greedy: Answer
    follower_cores: list[str]  # each follower rank's cores (Cpus_allowed_list), none for TP 1
    elsewhere_cores: float  # other processes' load during the sweep (Elsewhere)


def follower_cores(server: servers.Server) -> list[str]:
    """The cores of every follower rank the server's worker started (`... follower_entry()` processes)."""
    assert server.popen is not None
    found = []
    for pid, _ in servers.descendants(server.popen.pid):
        try:
            if b"follower_entry" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found += [line.split(":", 1)[1].strip() for line in status.splitlines()
                  if line.startswith("Cpus_allowed_list:")]
    return found


def measure_server(label: str, extra: list[str], args: argparse.Namespace, model_dir: Path, model_name: str,
                   work: Path, load: Load, concurrencies: list[int]) -> Served:
    server = servers.pdserve_server("colocated", model_dir, model_name, work / label,
                                    [*extra, *shlex.split(args.up_args)])
    server.name = label
    command = shlex.join(server.argv)
    say(f"starting {label}: {command}")
    server.start()
    try:
        try:
            ready_s = server.wait_ready(args.startup_timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n--- last lines of {server.log_path}:\n{server.log_tail()}\n---") from None
        cores = follower_cores(server)
        say(f"{label} ready after {ready_s:.0f} s" + (f"; follower ranks on cores {', '.join(cores)}" if cores else ""))
        target = Target(server.base_url, model_name)

        def on_level(s: LevelSummary) -> None:
            say(f"{label} concurrency {s.concurrency}: {s.output_tok_s:.1f} tok/s, ITL p50 {s.itl_ms_p50 or 0:.1f} ms, "
                f"{s.completed} ok, {s.failed} failed")

        assert server.popen is not None
        elsewhere = Elsewhere(server.popen.pid)
        summaries = asyncio.run(run_sweep(target, load, concurrencies, args.requests, args.warmup, ErrorReporter(),
                                          on_level))
        other = elsewhere.cores()
        greedy = ask_all(target, [GREEDY_PROMPT], GREEDY_TOKENS)[0]
        say(f"{label} greedy: {greedy.text!r}" if greedy.ok else f"{label} greedy request failed: {greedy.error}")
        return Served(label, command, ready_s, summaries, greedy, cores, other)
    finally:
        with servers.signals_deferred():  # a second Ctrl-C must not cut the stop short and leave ranks behind
            server.stop()
        say(f"{label} stopped")


METRICS = (("output tok/s", "output_tok_s", max), ("ITL p50", "itl_ms_p50", min), ("TTFT p50", "ttft_ms_p50", max))


def served_figures(served: dict[str, list[Served]], concurrencies: list[int]) -> list[tuple[str, dict]]:
    """Per metric (at the highest concurrency, ITL at the lowest): each arm's median and spread over the rounds,
    and TP2/TP1, where every round measured it."""
    found = []
    for what, metric, pick in METRICS:
        n = pick(concurrencies)
        values = {label: [getattr(level(run.summaries, n), metric, None) for run in runs]
                  for label, runs in served.items()}
        if any(v is None for vs in values.values() for v in vs) or not all(values.values()):
            continue
        figure = {label: Spread.of(vs) for label, vs in values.items()}
        if "tp1" in values and "tp2" in values:
            figure["tp2/tp1"] = Ratio.of(values["tp2"], values["tp1"])
        found.append((f"{what}, {n} stream{'s' if n > 1 else ''}", figure))
    return found


def same_greedy(served: dict[str, list[Served]]) -> bool | None:
    runs = [run for label in ("tp1", "tp2") for run in served.get(label, [])]
    if not served.get("tp1") or not served.get("tp2") or not all(run.greedy.ok for run in runs):
        return None
    return len({run.greedy.text for run in runs}) == 1


def print_served(served: dict[str, list[Served]], concurrencies: list[int]) -> None:
    rows = [(f"{name} r{k + 1}", s) for name, runs in served.items() for k, run in enumerate(runs)
            for s in run.summaries]
    print("\nserved: pdserve up --colocated, TP 1 against --tp-size 2 (times in ms; rK: round K)")
    print(format_table([s for _, s in rows], "server", [name for name, _ in rows]))
    for name, runs in served.items():
        for k, run in enumerate(runs):
            if errors := format_errors(run.summaries):
                print(f"{name} r{k + 1} {errors}")
    figures = served_figures(served, concurrencies)
    if figures:
        print("\nmedian (lowest-highest) over the rounds; TP2/TP1: of the medians (range of the rounds' quotients)")
        for what, figure in figures:
            cells = [f"{label} {value.text('.1f')}" for label, value in figure.items() if isinstance(value, Spread)]
            ratio = figure.get("tp2/tp1")
            print(f"  {what:<22} " + ", ".join(cells) + (f"; TP2/TP1 {ratio.text()}" if ratio else ""))
    print(f"\ngreedy ({GREEDY_PROMPT!r}, temperature 0, max_tokens {GREEDY_TOKENS})")
    for name, runs in served.items():
        for k, run in enumerate(runs):
            print(f"  {name} r{k + 1}: {run.greedy.text!r}" if run.greedy.ok
                  else f"  {name} r{k + 1}: failed: {run.greedy.error}")
    same = same_greedy(served)
    if same is not None:
        verdict = "yes" if same else "no (bf16 sums split over ranks may round apart)"
        print(f"  every TP1 and TP2 server gave the same text: {verdict}")


def print_elsewhere(collectives: list[Collective], served: dict[str, list[Served]]) -> None:
    """Other processes' load during each measurement: figures taken beside other work are disturbed."""
    found = [(f"{c.backend} all-reduce", c.elsewhere_cores) for c in collectives
             if c.shape == SHAPES[0] and c.dtype == DTYPES[0] and c.elsewhere_cores is not None]
    found += [(f"{name} r{k + 1} load", run.elsewhere_cores) for name, runs in served.items()
              for k, run in enumerate(runs)]
    if found:
        print("other processes on this machine meanwhile, cores busy on average: "
              + ", ".join(f"{what} {cores:.2f}" for what, cores in found))
        if any(cores > BUSY_ELSEWHERE for _, cores in found):
            print(f"  (above {BUSY_ELSEWHERE:g}: those figures were taken beside other work; rerun on a quiet machine)")


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="which to run, in order (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="servers of each kind, in rotating order")
    parser.add_argument("--concurrency", action="append", default=[], metavar="N[,N...]",
                        help="concurrency levels (default: 1,32)")
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default: 4 x concurrency)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests per server before measuring")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (ignore_eos)")
    parser.add_argument("--prompt-len", type=int, default=40, help="approximate prompt tokens")
    parser.add_argument("--ar-iters", type=int, default=500, help="all-reduce calls per timed block")
    parser.add_argument("--ar-blocks", type=int, default=5, help="timed blocks per case (the median is reported)")
    parser.add_argument("--ar-warmup", type=int, default=50, help="unmeasured all-reduce calls per case")
    parser.add_argument("--ar-timeout", type=float, default=300.0, help="seconds for one backend's whole run")
    servers.add_server_arguments(parser)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every result as JSON")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds takes a positive number")
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PARTS for x in parts):
        raise SystemExit(f"--parts takes a list of {', '.join(PARTS)}; got {args.parts!r}")
    concurrencies = parse_concurrencies(args.concurrency or ["1,32"])
    load = Load(output_len=args.output_len, prompt_len=args.prompt_len)

    servers.unwind_on_termination()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-tp-"))
    collectives: list[Collective] = []
    served: dict[str, list[Served]] = {label: [] for label, _ in SERVED}
    failed: list[str] = []
    try:
        if "collectives" in parts:
            collectives = run_collectives(args)
            if any(c.error or not c.summed_right for c in collectives):
                failed.append("collectives")
        if "served" in parts:
            try:
                model_dir = servers.default_model_dir(args.model_path)
            except subprocess.CalledProcessError as exc:
                print(f"error: cannot prepare the model:\n{exc.stderr or exc.stdout}", file=sys.stderr)
                return 1
            say(f"model {model_dir}; {args.output_len} output tokens, ~{args.prompt_len}-token prompts, "
                f"concurrency {','.join(map(str, concurrencies))}")
            for r in range(args.rounds):
                for label, extra in order(SERVED, r):
                    try:
                        served[label].append(measure_server(label, extra, args, model_dir, model_dir.name,
                                                            work / f"r{r + 1}", load, concurrencies))
                    except RuntimeError as exc:
                        failed.append(f"{label} r{r + 1}")
                        say(f"{label} (round {r + 1}) skipped: {exc}")
            served = {label: runs for label, runs in served.items() if runs}
    except KeyboardInterrupt:
        say("interrupted; every server and rank stopped")
        return 130
    finally:
        if args.keep_logs or failed:
            say(f"logs and state kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if collectives:
        print_collectives(collectives)
    if served:
        print_served(served, concurrencies)
    print(f"\n({args.rounds} round(s), this machine, {time.monotonic() - started:.0f} s in all)\ncommand: "
          f"{shlex.join([sys.executable, *sys.argv])}")
    for runs in served.values():
        print(f"  {runs[0].label}: {runs[0].command}")
    print_elsewhere(collectives, served)
    if args.json:
        payload = {
            "args": vars(args),
            "collectives": [asdict(c) | {"gloo_over_shm": collective_ratio(collectives, c.shape, c.dtype)}
                            for c in collectives],
            "servers": {name: [{"command": run.command, "ready_s": run.ready_s, "follower_cores": run.follower_cores,
                                "elsewhere_cores": run.elsewhere_cores,
                                "levels": [asdict(s) for s in run.summaries], "greedy": asdict(run.greedy)}
                               for run in runs] for name, runs in served.items()},
            "figures": {what: {label: value.as_dict() for label, value in figure.items()}
                        for what, figure in served_figures(served, concurrencies)},
            "greedy_same": same_greedy(served),
            "failed": failed,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
