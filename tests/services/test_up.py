"""`pdserve up`: its preflight errors, and its supervision of real child processes (its plan: test_up_plan.py).

The supervision tests run the real `pdserve up` with a real redis-server; the other services are replaced
(`--substitute`) by a small HTTP process that serves /health on the port `up` assigns and can be told to
print lines, die, or ignore SIGTERM. The whole system with the real services is tests/integration/test_up_e2e.py.
"""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.services import up, up_plan, up_preflight
from up_plans import by_name, parse, parsed_args

STAND_IN = r'''
import argparse, http.server, os, signal, sys, threading, time
own = argparse.ArgumentParser()
own.add_argument("--die-after", type=float)
own.add_argument("--die-when", help="die once this file exists")
own.add_argument("--exit-code", type=int, default=3)
own.add_argument("--lines", type=int, default=0)
own.add_argument("--no-health", action="store_true")
own.add_argument("--ignore-term", action="store_true")
own.add_argument("--lose-port-once", help="the first time (this file absent) fail as a worker whose port is taken")
mine, rest = own.parse_known_args()
svc = argparse.ArgumentParser()
svc.add_argument("--port", type=int)
svc.add_argument("--http-port", type=int)
ports, _ = svc.parse_known_args(rest)
if mine.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("argv:", " ".join(rest), flush=True)
if mine.lose_port_once and not os.path.exists(mine.lose_port_once):
    open(mine.lose_port_once, "w").close()
    print(f"cannot listen on 127.0.0.1:{ports.port} (port in use? pass --port)", flush=True)
    sys.exit(1)
for i in range(mine.lines):
    print(f"line {i}", flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass

if not mine.no_health:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", ports.http_port or ports.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("serving", flush=True)
if mine.die_after is not None:
    time.sleep(mine.die_after)
while mine.die_after is None:
    time.sleep(0.05)
    if mine.die_when and os.path.exists(mine.die_when):
        break
print("dying now", flush=True)
sys.exit(mine.exit_code)
'''


# ---------------------------------------------------------------- helpers


def port_is_free(port: int) -> bool:
    return not up_preflight.port_in_use("127.0.0.1", port)


def free_ports(workers: int) -> dict[str, int]:
    """Ports for one `up` run: gateway, jobs and redis from the kernel, a free worker block below them."""
    ports = {}
    for name in ("port", "jobs_port", "redis_port"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports[name] = s.getsockname()[1]
    for _ in range(200):
        base = random.randrange(20000, 26900)
        if all(port_is_free(base + i + off) for i in range(workers) for off in (0, 1000, 2000)):
            ports["worker_port"] = base
            return ports
    raise RuntimeError("no free block of worker ports")


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


class UpRun:
    """`pdserve up` as a real subprocess, its merged output collected line by line."""

    def __init__(self, tmp_path: Path, *extra: str, substitute: dict[str, str], workers: int = 2,
                 worker_port: bool = True) -> None:
        self.ports = free_ports(workers)
        if not worker_port:  # `up` chooses the worker ports
            del self.ports["worker_port"]
        model = tmp_path / "model"  # only the stand-ins receive it; `up` checks it is an HF directory
        model.mkdir(exist_ok=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (model / name).write_text("{}")
        script = tmp_path / "stand_in.py"
        script.write_text(STAND_IN)
        self.state = tmp_path / "state"
        argv = [sys.executable, "-m", "pdserve", "up", "--model-path", str(model), "--state-dir", str(self.state),
                "--port", str(self.ports["port"]), "--jobs-port", str(self.ports["jobs_port"]),
                "--redis-port", str(self.ports["redis_port"]), "--startup-timeout", "60", *extra]
        if worker_port:
            argv += ["--worker-port", str(self.ports["worker_port"])]
        for name, options in substitute.items():
            argv += ["--substitute", f"{name}={sys.executable} {script} {options}".rstrip()]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                self._reader.join(5)
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in the output of up:\n{self.output}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def child_pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2))
                for m in (re.search(r"^\[up\] started (\S+) \(pid (\d+)\)", line) for line in list(self.lines)) if m}

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in pids_alive(list(self.child_pids().values())):
            os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def run_up(tmp_path):
    runs: list[UpRun] = []

    def start(*extra: str, substitute: dict[str, str], workers: int = 2, worker_port: bool = True) -> UpRun:
        runs.append(UpRun(tmp_path, *extra, substitute=substitute, workers=workers, worker_port=worker_port))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def get(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        return response.status


# ---------------------------------------------------------------- preflight


def test_port_in_use_is_named_with_the_flag_that_moves_it(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        gateway = by_name(up_plan.build_plan(parse("--port", str(taken)), tmp_path, cpus=2))["gateway"]
        with pytest.raises(up.UpError, match=rf"port {taken} is in use \(gateway port\).*--port"):
            up_preflight.check_ports([gateway])
    up_preflight.check_ports([gateway])  # released: accepted


def test_worker_port_in_use_names_worker_port_flag(tmp_path):
    base = free_ports(2)["worker_port"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 1 + 1000))  # the decode worker's HTTP port
        holder.listen()
        plan = up_plan.build_plan(parse("--worker-port", str(base), "--port", "0", "--jobs-port", "0",
                                        "--redis-port", "0"), tmp_path, cpus=2)
        plan.services = [s for s in plan.services if s.name in ("prefill", "decode")]
        with pytest.raises(up.UpError, match=rf"port {base + 1001} is in use \(decode HTTP port.*--worker-port"):
            up_preflight.check_ports(plan.services)


def test_the_same_port_planned_twice_is_refused(tmp_path):
    plan = up_plan.build_plan(parse("--port", "30500", "--jobs-port", "30500"), tmp_path, cpus=2)
    with pytest.raises(up.UpError, match=r"port 30500 is planned twice: jobs port \(--jobs-port\) and gateway port \(--port\)"):
        up_preflight.check_ports(plan.services)


def test_missing_redis_server_gives_the_install_hint(tmp_path, monkeypatch):
    plan = up_plan.build_plan(parse(), tmp_path, cpus=2)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(up.UpError, match=r"redis-server is not installed.*apt-get install redis-server.*--redis-url"):
        up_preflight.check_executables(plan.services)


def test_substitute_of_an_unknown_service_is_refused(tmp_path):
    plan = up_plan.build_plan(parse(), tmp_path, cpus=2)
    with pytest.raises(up.UpError, match="NAME one of redis, prefill, decode, jobs, gateway"):
        up_plan.substitute(plan, ["router=true"])


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # Every other port free too: the defaults sit in the ephemeral range, where a test's client
        # connections may hold one for a moment.
        ports = free_ports(2)
        others = ["--jobs-port", str(ports["jobs_port"]), "--redis-port", str(ports["redis_port"]),
                  "--worker-port", str(ports["worker_port"])]
        result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--port", str(taken), *others, "--state-dir",
                                 str(tmp_path / "state"), "--model-path", str(tmp_path / "missing")],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"error: port {taken} is in use (gateway port)" in result.stderr
    assert "started" not in result.stdout


def test_up_refuses_a_missing_model(tmp_path):
    ports = free_ports(2)
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model-path", str(tmp_path / "nope"),
                             "--state-dir", str(tmp_path / "state"), *[a for k, v in ports.items()
                                                                       for a in (f"--{k.replace('_', '-')}", str(v))]],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"model path '{tmp_path / 'nope'}' does not exist" in result.stderr
    assert "started" not in result.stdout


# ---------------------------------------------------------------- supervision (real processes)

ALL_STAND_INS = {"prefill": "", "decode": "", "jobs": "", "gateway": ""}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_up_starts_in_stages_prefixes_logs_and_stops_everything_on_signal(run_up, sig):
    run = run_up(substitute=ALL_STAND_INS)
    run.wait_for(r"OpenAI base URL: http://127\.0\.0\.1:\d+/v1")
    p = run.ports
    # Every service is up and reachable where the plan put it; redis is the real one.
    assert get(f"http://127.0.0.1:{p['port']}/health") == 200
    assert get(f"http://127.0.0.1:{p['jobs_port']}/health") == 200
    # Redis answers only with the password of this run, from a config file only this user can read.
    config = run.state / "redis.conf"
    assert oct(config.stat().st_mode & 0o777) == "0o600"
    password = re.fullmatch(r'requirepass "(\S+)"\n', config.read_text()).group(1)
    assert not up.probe(f"redis://127.0.0.1:{p['redis_port']}/0")
    assert up.probe(f"redis://:{password}@127.0.0.1:{p['redis_port']}/0")
    out = run.output
    assert password not in out
    assert re.search(rf"^\[decode\] argv: decode .*--prefill 127\.0\.0\.1:{p['worker_port']}", out, re.M)
    assert re.search(r"^\[gateway\] argv: gateway .*--decode 127\.0\.0\.1:\d+ --jobs-url", out, re.M)
    assert re.search(r"^\[redis\] .*Ready to accept connections", out, re.M)
    order = [line.split()[2] for line in run.lines if line.startswith("[up] started ")]
    assert order == ["redis", "prefill", "jobs", "decode", "gateway"]
    # Each stage starts only once the one before is healthy.
    assert out.index("[up] redis is healthy") < out.index("[up] started prefill")
    assert out.index("[up] prefill is healthy") < out.index("[up] started decode")
    assert out.index("[up] decode is healthy") < out.index("[up] started gateway")
    pids = list(run.child_pids().values())
    assert len(pids_alive(pids)) == 5

    os.kill(run.proc.pid, sig)
    assert run.wait_exit(30) == 0
    assert pids_alive(pids) == []
    assert f"[up] {sig.name}: stopping every service" in run.output
    assert port_is_free(p["port"]) and port_is_free(p["redis_port"])
    assert (run.state / "logs" / "gateway.log").read_text().startswith("argv: gateway")
    assert any((run.state / "redis").rglob("*.aof")), "redis ran without its append-only file in the state dir"
    assert not config.exists()


def test_a_child_that_dies_during_start_up_stops_the_rest_and_nothing_more_starts(run_up):
    run = run_up(substitute={**ALL_STAND_INS, "jobs": "--die-after 0 --exit-code 2"})
    assert run.wait_exit(60) == 1
    out = run.output
    assert "error: jobs exited with code 2 before the system was ready" in out
    assert "  | dying now" in out
    assert "[up] started gateway" not in out and "OpenAI base URL" not in out
    assert pids_alive(list(run.child_pids().values())) == []


def test_a_child_that_never_turns_healthy_times_out(run_up):
    run = run_up("--startup-timeout", "2", substitute={**ALL_STAND_INS, "prefill": "--no-health"})
    assert run.wait_exit(60) == 1
    out = run.output
    assert re.search(r"error: prefill did not become healthy within 2 s \(checked http://127\.0\.0\.1:\d+/health\)",
                     out)
    assert "[up] started decode" not in out
    assert pids_alive(list(run.child_pids().values())) == []


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(run_up):
    run = run_up("--stop-timeout", "1", substitute={**ALL_STAND_INS, "gateway": "--ignore-term"})
    run.wait_for("OpenAI base URL")
    pids = run.child_pids()
    started = time.monotonic()
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait_exit(30) == 0
    assert time.monotonic() - started < 15
    assert "[up] gateway did not stop within 1 s: killing it" in run.output
    assert pids_alive(list(pids.values())) == []


def test_lora_flags_reach_every_generating_worker(tmp_path):
    from pdserve import cli
    from pdserve.services.worker.channel.settings import lora_config

    adapter = tmp_path / "sql"
    plan = up_plan.build_plan(parse("--lora-paths", f"sql={adapter}", "--max-lora-rank", "32",
                                    "--max-loras-per-batch", "4", "--lora-target-modules", "all"), tmp_path, cpus=2)
    workers = [s for s in plan.services if s.args[0] in ("prefill", "decode")]
    assert len(workers) == 2
    for service in workers:
        parser, _ = cli.build_parser(service.args)
        parsed = parser.parse_args(service.args)
        lora = lora_config(parsed)  # what the worker serves
        assert lora.paths == (("sql", str(adapter)),)
        assert (lora.max_rank, lora.max_loras_per_batch, parsed.lora_target_modules) == (32, 4, ["all"])
    plain = up_plan.build_plan(parse("--colocated"), tmp_path, cpus=2)
    assert not any("--lora" in " ".join(s.args) for s in plain.services)


UP_CONFIG = """
colocated = true
context-length = 1024
max_running_requests = 7
page-size = 32
schedule-policy = "lpm"
random-seed = 5
log-format = "json"
reasoning-parser = "qwen3"
max-queued-requests = 9
"""


def test_up_started_with_flags_and_a_config_file_passes_them_to_its_services(run_up, tmp_path):
    config = tmp_path / "up.toml"
    config.write_text(UP_CONFIG)
    run = run_up("--config", str(config), "--page-size", "64", "--mem-fraction-static", "0.7", "--log-requests",
                 substitute={"colocated": "", "jobs": "", "gateway": ""}, workers=1)
    run.wait_for(r"OpenAI base URL")
    argv = {m.group(1): m.group(2).split() for m in (re.search(r"^\[(\w+)\] argv: (.*)$", line)
                                                     for line in run.lines) if m}
    assert set(argv) == {"colocated", "jobs", "gateway"}
    worker = parsed_args(argv["colocated"])
    assert (worker.context_length, worker.max_running_requests, worker.schedule_policy, worker.random_seed,
            worker.log_format, worker.mem_fraction) == (1024, 7, "lpm", 5, "json", 0.7)
    assert worker.page_size == 64  # the command line wins over the file
    gateway = parsed_args(argv["gateway"])
    assert (gateway.reasoning_parser, gateway.max_queued_requests, gateway.log_requests, gateway.log_format) == \
        ("qwen3", 9, True, "json")
    assert parsed_args(argv["jobs"]).log_format == "json"
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait_exit(30) == 0
