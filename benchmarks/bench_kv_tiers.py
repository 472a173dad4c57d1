"""KV cache tiers: servers with the storage tier under the radix cache (`--enable-hierarchical-cache
--hicache-storage-backend file --hicache-storage-dir DIR`, shared/kv_tiers.py) against the same servers without it,
driven over HTTP, one case at a time on this machine.

    .venv/bin/python benchmarks/bench_kv_tiers.py [--cases multiturn,pd,no-reuse,restart,long] [--conversations 16]
        [--concurrency 8] [--write-policy P] [--prefetch-policy P] [--up-args="..."] [--json FILE]  (--help: sizes)

The issue's full size is `--conversations 64` (8 in flight). On a 2-core CPU machine with the default model
(SmolLM2-135M) that takes about 35 minutes when nothing else runs there (the multi-turn cases about 12 and 17) and
up to an hour beside other work: split it there (`--cases multiturn,no-reuse,restart`, then `--cases pd`). The
default, 16 conversations, took 11 minutes there (each multi-turn case about 4), 13 to 20 beside other work; its
pool holds 4 conversations at their longest, so 4 are in flight, not 8 (32 conversations keep 8, in twice the time).
Every case starts servers of its own (`pdserve up` on free loopback ports, servers.py) with a fresh storage
directory and stops them before the next; servers compared are up at once and measured in turn (ABBA), so both see
the machine alike.

    multiturn  colocated, with the tier and without, the same pool: N conversations of `turns` turns, each with a
               document of about doc-len tokens of its own as the system prompt; each turn appends the last
               answer and a new question and streams output-len tokens (ignore_eos, greedy). `concurrency` turns
               are in flight, one turn of every conversation at a time (a wave; the servers take waves in
               turn), so a conversation's next turn comes after every other conversation's; the pool
               (--max-total-tokens) is 1/pool-factor of the conversations' KV, so without the tier what a
               conversation left in the pool is gone by its next turn.
               Targets: turns 2+ TTFT p50 with/without <= 0.35; output tok/s with/without >= 1.5.
    pd         the same on `pdserve up` (a prefill and a decode worker), the same targets; and both workers run
               with the tier flags (read from their command lines).
    no-reuse   colocated, the same pool and concurrency: distinct prompts of about doc-len tokens, each sent once
               (every page written, none read). Target: output tok/s with/without >= 0.97.
    restart    server A (tier) computes prompts of about restart-len tokens while server C (tier, the same
               directory) is up; A stops; B (tier, the same directory) starts with a cold pool. B's TTFT p50 of A's
               prompts against prompts nobody has seen, of the same length, on B: <= 0.3; C's of prompts only A
               saw against unseen ones on C: <= 0.3.
    long       a prompt of long-len tokens (past a quarter of a long-pool pool) pushed out by five others and
               asked again (kv_tiers_long.py). Targets: >= 1,000 cached tokens; TTFT p50 read back / cold <= 0.35.
    greedy     within the others: temperature-0 answers of a few prompts identical with and without the tier
               (sent to both servers before and after the multi-turn load, after which the tier server reads
               them back from storage), and B's and C's answers to A's prompts identical to A's.

TTFT is the time to the first content chunk of a streamed chat completion. Servers and whatever they started are
stopped on exit, Ctrl-C and errors included.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

import servers
from kv_tiers_load import (QUESTION_LEN, Answer, Check, Conversations, ask_all, greedy_prompts, ratio_check,
                           same_answers, text, ttft_ms_p50)
from kv_tiers_long import long_case
from pdserve.benchclient import ErrorReporter, Load, Target, make_prompts, run_level

CASES = ("multiturn", "pd", "no-reuse", "restart", "long")
TEMPLATE_TOKENS = 48  # the chat template's own tokens in a conversation, generously


# ---------------------------------------------------------------- servers


@dataclass
class Context:
    args: argparse.Namespace
    model_dir: Path
    model_name: str
    work: Path
    commands: list[tuple[str, str]] = field(default_factory=list)  # (server, its command line)

    def server(self, name: str, mode: str, extra: list[str]) -> servers.Server:
        args = self.args
        flags = ["--page-size", str(args.page_size), "--enable-cache-report", *extra, *shlex.split(args.up_args)]
        server = servers.pdserve_server(mode, self.model_dir, self.model_name, self.work / name, flags)
        server.name = name
        self.commands.append((name, shlex.join(server.argv)))
        return server

    def storage(self, name: str) -> Path:
        """A fresh, empty storage directory."""
        path = self.work / "storage" / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def tier_flags(self, directory: Path) -> list[str]:
        args = self.args
        return ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir",
                str(directory), "--hicache-write-policy", args.write_policy, "--hicache-storage-prefetch-policy",
                args.prefetch_policy,
                *(["--hicache-storage-prefetch-timeout", str(args.prefetch_timeout)] if args.prefetch_timeout else [])]

    def target(self, server: servers.Server) -> Target:
        return Target(server.base_url, self.model_name)


@contextlib.contextmanager
def serving(*group: servers.Server, timeout_s: float):
    """Start every server of `group` at once, wait until each serves; stop them all afterwards, whatever happens."""
    try:
        for server in group:
            print(f"[tiers] starting {server.name}", flush=True)
            server.start()
        for server in group:
            try:
                ready = server.wait_ready(timeout_s)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n--- last lines of {server.log_path}:\n{server.log_tail()}") from None
            print(f"[tiers] {server.name} ready after {ready:.0f} s", flush=True)
        yield
    finally:
        with servers.signals_deferred():  # a second Ctrl-C must not cut the stops short
            for server in group:
                server.stop()


def warm(ctx: Context, server: servers.Server, length: int) -> None:
    """Unmeasured: a short prompt and a long one, so first-use costs fall outside the figures."""
    ask_all(ctx.target(server), ["Say hello.", text(f"warm-{server.name}", 0, length)], max_tokens=8)


def stored(directory: Path) -> tuple[int, int]:
    """(page files, bytes) in a storage directory."""
    files = list(directory.rglob("*.kv"))
    return len(files), sum(f.stat().st_size for f in files if f.exists())


def settle(directory: Path, quiet_s: float = 1.5, timeout_s: float = 120.0) -> None:
    """Until the tier's writes have landed: the number of page files stops changing for `quiet_s`."""
    last, since, end = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        count = stored(directory)[0]
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.25)


def roles_with_tier_flags(server: servers.Server) -> dict[str, bool]:
    """For each worker `up` started (`python -m pdserve ROLE ...`): whether its command line has the tier's directory."""
    found: dict[str, bool] = {}
    assert server.popen is not None
    for pid, _ in servers.descendants(server.popen.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-2]):
            if arg == "-m" and argv[i + 1] == "pdserve" and argv[i + 2] in ("prefill", "decode", "colocated"):
                found[argv[i + 2]] = found.get(argv[i + 2], False) or "--hicache-storage-dir" in argv
    return found


# ---------------------------------------------------------------- cases


def pool_for(args: argparse.Namespace) -> tuple[int, int, int]:
    """(pool tokens, the conversations' KV as estimated, concurrency): the pool is 1/pool-factor of the KV, in whole
    pages; the concurrency is lowered when the pool cannot hold that many conversations at their longest."""
    longest = TEMPLATE_TOKENS + args.doc_len + args.turns * (QUESTION_LEN + 8 + args.output_len)
    kv = args.conversations * longest
    pool = int(kv / args.pool_factor) // args.page_size * args.page_size
    concurrency = max(1, min(args.concurrency, pool // longest))
    if concurrency < args.concurrency:
        print(f"[tiers] a pool of {pool} tokens holds {concurrency} conversations at their longest (~{longest} "
              f"tokens): concurrency {concurrency}, not {args.concurrency} (more --conversations keep it)", flush=True)
    return pool, kv, concurrency


def multiturn_case(ctx: Context, case: str, mode: str) -> list[Check]:
    """Both servers up at once, the waves taken in turn (ABBA), so both see the machine alike."""
    args = ctx.args
    pool, estimate, concurrency = pool_for(args)
    print(f"[tiers] {case}: {args.conversations} conversations x {args.turns} turns, ~{args.doc_len}-token documents, "
          f"{args.output_len} output tokens, {concurrency} in flight; pool {pool} tokens, the conversations' KV "
          f"~{estimate} tokens", flush=True)
    store = ctx.storage(case)
    plain = ctx.server(case, mode, ["--max-total-tokens", str(pool)])
    tiered = ctx.server(f"{case}-tiers", mode, ["--max-total-tokens", str(pool), *ctx.tier_flags(store)])
    runs = {plain.name: Conversations(args, concurrency), tiered.name: Conversations(args, concurrency)}
    greedy = greedy_prompts(args.doc_len)
    answers: dict[str, list[Answer]] = {}
    with serving(plain, tiered, timeout_s=args.startup_timeout):
        flags_on = roles_with_tier_flags(tiered)
        for server in (plain, tiered):
            warm(ctx, server, args.doc_len)
            ask_all(ctx.target(server), greedy)  # computed; after the load, read back from storage if the tier has them
        for turn in range(1, args.turns + 1):
            for server in (plain, tiered) if turn % 2 else (tiered, plain):
                runs[server.name].wave(ctx.target(server), turn)
                if server is tiered:
                    settle(store)  # its writes land before the other server's wave
            print(f"[tiers] {case} turn {turn}: " + ", ".join(
                f"{name} {run.duration_s:.0f} s" for name, run in runs.items()), flush=True)
        for server in (plain, tiered):
            answers[server.name] = ask_all(ctx.target(server), greedy)
        pages, size = stored(store)
    shutil.rmtree(store, ignore_errors=True)
    for name, run in runs.items():
        print(f"[tiers] {name}: {run.duration_s:.0f} s, {run.output_tok_s():.1f} output tok/s, turns 2+ TTFT p50 "
              f"{run.later_ttft_ms() or 0:.0f} ms, cached tokens p50 {run.cached_later()}, {len(run.ok())} turns ok, "
              f"{len(run.turns) - len(run.ok())} failed; greedy prompts after the load: cached tokens "
              f"{[x.cached_tokens for x in answers[name]]}", flush=True)
        for error, count in run.errors().items():
            print(f"[tiers] {name} failed {count} x {error}", flush=True)
    print(f"[tiers] {tiered.name} stored {pages} pages ({size / 2**20:.0f} MiB)", flush=True)
    none, tier = runs[plain.name], runs[tiered.name]
    kv = max(none.kv_tokens(), tier.kv_tokens())
    checks = [Check(case, "the conversations' KV / the pool", ">= 4", f"{kv / pool:.1f} ({kv} / {pool} tokens)",
                    kv / pool >= 4),
              ratio_check(case, "turns 2+ TTFT p50, tier / none", tier.later_ttft_ms(), none.later_ttft_ms(), 0.35,
                          False, "ms"),
              ratio_check(case, "output tok/s, tier / none", tier.output_tok_s(), none.output_tok_s(), 1.5, True,
                          "tok/s"),
              same_answers(case, "greedy answers, tier (read back) = none", answers[tiered.name], answers[plain.name])]
    if mode == "pd":
        roles = ", ".join(f"{role} {'yes' if on else 'no'}" for role, on in sorted(flags_on.items()))
        checks.append(Check(case, "tier flags on the workers", "prefill and decode", roles or "-",
                            flags_on.get("prefill", False) and flags_on.get("decode", False)))
    return checks


def no_reuse_case(ctx: Context) -> list[Check]:
    args = ctx.args
    pool, _, concurrency = pool_for(args)  # the multi-turn case's pool and concurrency
    store = ctx.storage("no-reuse-tiers")
    plain = ctx.server("no-reuse", "colocated", ["--max-total-tokens", str(pool)])
    tiered = ctx.server("no-reuse-tiers", "colocated", ["--max-total-tokens", str(pool), *ctx.tier_flags(store)])
    load = Load(output_len=args.output_len, prompt_len=args.doc_len)
    tokens = {plain.name: 0, tiered.name: 0}
    seconds = {plain.name: 0.0, tiered.name: 0.0}
    failed = 0
    with serving(plain, tiered, timeout_s=args.startup_timeout):
        for server in (plain, tiered):
            warm(ctx, server, args.doc_len)
        for r in range(args.rounds):  # in turn, ABBA, so both see the machine alike; the same prompts, once each
            prompts = make_prompts(args.no_reuse_requests, args.doc_len, 1000 + r)
            for server in (plain, tiered) if r % 2 == 0 else (tiered, plain):
                async def level() -> tuple[list, float]:
                    async with aiohttp.ClientSession() as session:
                        return await run_level(session, ctx.target(server), load, prompts, concurrency,
                                               ErrorReporter())
                results, duration = asyncio.run(level())
                tokens[server.name] += sum(x.output_tokens for x in results if x.ok)
                seconds[server.name] += duration
                failed += sum(not x.ok for x in results)
                print(f"[tiers] no-reuse round {r + 1} {server.name}: "
                      f"{sum(x.output_tokens for x in results if x.ok) / duration:.1f} output tok/s", flush=True)
                if server is tiered:
                    settle(store)  # its writes land before the other server measures
        pages, size = stored(store)
        print(f"[tiers] no-reuse-tiers stored {pages} pages ({size / 2**20:.0f} MiB)", flush=True)
    shutil.rmtree(store, ignore_errors=True)
    check = ratio_check("no-reuse", "output tok/s, tier / none", tokens[tiered.name] / seconds[tiered.name],
                        tokens[plain.name] / seconds[plain.name], 0.97, True, "tok/s")
    if failed:
        check.figure += f" ({failed} requests failed)"
        check.met = False
    return [check]


def restart_case(ctx: Context) -> list[Check]:
    args = ctx.args
    store = ctx.storage("restart")
    flags = ctx.tier_flags(store)
    n, length = args.reps, args.restart_len
    seen_by_a = [text("restart-a", i, length) for i in range(n)]  # A computes them; B, after A, reads them back
    only_a = [text("restart-shared", i, length) for i in range(n)]  # A computes them; C, beside A, reads them back
    a, c = ctx.server("restart-a", "colocated", flags), ctx.server("restart-c", "colocated", flags)
    b = ctx.server("restart-b", "colocated", flags)

    def alternate(server: servers.Server, cold: list[str], known: list[str]) -> tuple[list[Answer], list[Answer]]:
        """Unseen and stored prompts in turn, one at a time."""
        pairs = [ask_all(ctx.target(server), [x, y]) for x, y in zip(cold, known)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    with serving(a, c, timeout_s=args.startup_timeout):
        warm(ctx, a, length)
        warm(ctx, c, length)
        computed = ask_all(ctx.target(a), seen_by_a + only_a)
        settle(store)
        cold_c, shared = alternate(c, [text("restart-cold-c", i, length) for i in range(n)], only_a)
    pages, size = stored(store)
    print(f"[tiers] restart: stored {pages} pages ({size / 2**20:.0f} MiB) after A; A stopped", flush=True)
    with serving(b, timeout_s=args.startup_timeout):
        warm(ctx, b, length)
        cold_b, restored = alternate(b, [text("restart-cold-b", i, length) for i in range(n)], seen_by_a)
    shutil.rmtree(store, ignore_errors=True)
    for what, answers in (("A computed", computed), ("C unseen", cold_c), ("C only A saw", shared),
                          ("B unseen", cold_b), ("B A's, after restart", restored)):
        print(f"[tiers] restart {what}: TTFT " + ", ".join(f"{x.ttft_s * 1e3:.0f}" if x.ok else x.error or "failed"
                                                         for x in answers) + " ms, cached tokens "
              + ", ".join(str(x.cached_tokens) for x in answers), flush=True)
    return [ratio_check("restart", "new server, same dir: TTFT p50 stored / unseen", ttft_ms_p50(restored), ttft_ms_p50(cold_b),
                        0.3, False, "ms"),
            ratio_check("restart", "second server: TTFT p50 only-A's / unseen", ttft_ms_p50(shared), ttft_ms_p50(cold_c), 0.3,
                        False, "ms"),
            same_answers("restart", "greedy answers, read back = computed", restored + shared, computed)]


# ---------------------------------------------------------------- main


def print_report(checks: list[Check], ctx: Context, started: float) -> None:
    rows = [("case", "what", "target", "figure", "verdict")]
    rows += [(c.case, c.what, c.target, c.figure, "n/a" if c.met is None else "met" if c.met else "missed")
             for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"\n(one run, this machine, {time.monotonic() - started:.0f} s in all)\ncommand: "
          f"{shlex.join([sys.executable, *sys.argv])}")
    for name, command in ctx.commands:
        print(f"  {name}: {command}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="which to run, in order (default: %(default)s)")
    parser.add_argument("--conversations", type=int, default=16, help="multi-turn conversations (the issue's: 64)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--doc-len", type=int, default=1000, help="tokens of each conversation's document")
    parser.add_argument("--output-len", type=int, default=64, help="tokens of each answer")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--pool-factor", type=float, default=4.0, help="the conversations' KV / the pool")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--restart-len", type=int, default=2000, help="tokens of the restart case's prompts")
    parser.add_argument("--reps", type=int, default=3, help="prompts of each kind in the restart and long cases")
    parser.add_argument("--long-len", type=int, default=1900, help="tokens of the long case's prompts")
    parser.add_argument("--long-pool", type=int, default=4096, help="the long case's pool (--max-total-tokens)")
    parser.add_argument("--no-reuse-requests", type=int, default=16, help="prompts per round and server")
    parser.add_argument("--rounds", type=int, default=2, help="no-reuse rounds per server")
    parser.add_argument("--write-policy", default="write_through",
                        choices=("write_through", "write_through_selective", "write_back"))
    parser.add_argument("--prefetch-policy", default="best_effort", choices=("best_effort", "wait_complete", "timeout"))
    parser.add_argument("--prefetch-timeout", type=float, default=None, help="seconds (default: the server's)")
    servers.add_server_arguments(parser)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the checks as JSON")
    args = parser.parse_args()
    cases = [x for x in args.cases.split(",") if x]
    if not cases or any(x not in CASES for x in cases):
        raise SystemExit(f"--cases takes a list of {', '.join(CASES)}; got {args.cases!r}")

    servers.unwind_on_termination()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-kv-tiers-"))
    checks: list[Check] = []
    failed = False
    try:
        try:
            model_dir = servers.default_model_dir(args.model_path)
        except subprocess.CalledProcessError as exc:
            print(f"error: cannot prepare the model:\n{exc.stderr or exc.stdout}", file=sys.stderr)
            return 1
        ctx = Context(args, model_dir, model_dir.name, work)
        print(f"[tiers] model {model_dir}; cases {', '.join(cases)}", flush=True)
        for case in cases:
            try:
                if case in ("multiturn", "pd"):
                    checks += multiturn_case(ctx, case, "colocated" if case == "multiturn" else "pd")
                elif case == "no-reuse":
                    checks += no_reuse_case(ctx)
                elif case == "long":
                    checks += long_case(ctx, serving, warm)
                else:
                    checks += restart_case(ctx)
            except RuntimeError as exc:
                failed = True
                print(f"[tiers] {case} skipped: {exc}", flush=True)
                checks.append(Check(case, "the case ran", "yes", f"no: {str(exc).splitlines()[0]}", False))
    except KeyboardInterrupt:
        print("[tiers] interrupted; every server stopped", flush=True)
        return 130
    finally:
        if args.keep_logs or failed:
            print(f"[tiers] logs and state kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print_report(checks, ctx, started)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "checks": [asdict(c) for c in checks],
                                               "commands": dict(ctx.commands)}, indent=2))
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
