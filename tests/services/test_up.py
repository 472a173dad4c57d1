"""`pdserve up`: the plan it builds, its preflight errors, and its supervision of real child processes.

The supervision tests run the real `pdserve up` with a real redis-server; the other services are replaced
(`--substitute`) by a small HTTP process that serves /health on the port `up` assigns and can be told to
print lines, die, or ignore SIGTERM. The whole system with the real services is tests/integration/test_up_e2e.py.
"""
from __future__ import annotations

import argparse
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
from urllib.parse import urlsplit

import pytest

from pdserve.services import up, up_flags, up_preflight

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


def parse(*argv: str, state_dir: str = "/tmp/pdserve-state") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "up")
    return parser.parse_args([*argv, "--state-dir", state_dir])


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def by_name(plan: up.Plan) -> dict[str, up.Service]:
    return {s.name: s for s in plan.services}


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


# ---------------------------------------------------------------- plan


def test_plan_pd_pair_wires_every_service_to_the_others(tmp_path):
    plan = up.build_plan(parse(state_dir=str(tmp_path)), tmp_path / "SmolLM2", cpus=2)
    s = by_name(plan)
    assert [x.name for x in sorted(plan.services, key=lambda x: x.stage)][:1] == ["redis"]
    assert s["redis"].stage < s["prefill"].stage < s["decode"].stage < s["gateway"].stage
    assert s["jobs"].stage < s["gateway"].stage
    assert s["redis"].argv[:1] == ["redis-server"]
    assert flag_values(s["redis"].args, "--appendonly") == ["yes"]
    assert flag_values(s["redis"].args, "--dir") == [str(tmp_path / "redis")]
    assert flag_values(s["redis"].args, "--bind") == ["127.0.0.1"]
    for name in ("prefill", "decode", "jobs", "gateway"):
        assert s[name].argv[:4] == [sys.executable, "-m", "pdserve", name]
    for name in ("prefill", "decode", "gateway"):
        assert flag_values(s[name].args, "--model-path") == [str(tmp_path / "SmolLM2")]
    # The default worker block (before `prepare` checks it is free), below the ephemeral range.
    assert flag_values(s["prefill"].args, "--port") == ["20051"]
    assert flag_values(s["prefill"].args, "--http-port") == ["21051"]
    assert s["prefill"].health_url == "http://127.0.0.1:21051/health"
    assert flag_values(s["decode"].args, "--port") == ["20052"]
    assert flag_values(s["decode"].args, "--transfer-port") == ["22052"]
    assert flag_values(s["decode"].args, "--prefill") == ["127.0.0.1:20051"]
    assert flag_values(s["gateway"].args, "--prefill") == ["127.0.0.1:20051"]
    assert flag_values(s["gateway"].args, "--decode") == ["127.0.0.1:20052"]
    assert flag_values(s["gateway"].args, "--jobs-url") == ["http://127.0.0.1:30010"]
    assert flag_values(s["gateway"].args, "--port") == ["30000"]
    assert flag_values(s["gateway"].args, "--served-model-name") == ["SmolLM2"]
    # Redis requires a password of this run, which reaches jobs in its environment only.
    password = urlsplit(s["jobs"].env["PDSERVE_REDIS_URL"]).password
    assert len(password) >= 32 and flag_values(s["jobs"].args, "--redis-url") == []
    assert s["jobs"].env["PDSERVE_REDIS_URL"] == f"redis://:{password}@127.0.0.1:6379/0"
    # The admin key of this run reaches the gateway only, and is left in a file only this user can read.
    admin = s["gateway"].env["PDSERVE_ADMIN_API_KEY"]
    assert len(admin) >= 32 and all("PDSERVE_ADMIN_API_KEY" not in s[name].env for name in ("jobs", "prefill", "decode"))
    assert plan.private_files == {tmp_path / "redis.conf": f'requirepass "{password}"\n',
                                  tmp_path / "admin-api-key": admin + "\n"}
    assert s["redis"].args[0] == str(tmp_path / "redis.conf")
    assert flag_values(s["jobs"].args, "--gateway-url") == ["http://127.0.0.1:30000"]
    assert s["gateway"].health_url == "http://127.0.0.1:30000/health"
    assert s["jobs"].health_url == "http://127.0.0.1:30010/health"
    assert plan.base_url == "http://127.0.0.1:30000/v1"
    # No API key configured: none is passed.
    assert all("--api-key" not in x.args for x in plan.services)


@pytest.mark.parametrize("argv, cpus, expected", [
    ((), 2, {"prefill": "1", "decode": "2"}),
    (("--colocated",), 2, {"colocated": "2"}),
    (("--prefill", "3", "--decode", "2"), 16, {"prefill-0": "3", "decode-1": "8"}),
    (("--prefill", "3", "--decode", "2"), 2, {"prefill-2": "1", "decode-0": "1"}),
    (("--threads", "4",), 2, {"prefill": "4", "decode": "4"}),
    (("--threads", "1",), 2, {"prefill": "1", "decode": "1"}),
])
def test_plan_gives_decode_the_cores_and_prefill_a_share(tmp_path, argv, cpus, expected):
    s = by_name(up.build_plan(parse(*argv), tmp_path, cpus=cpus))
    for name, threads in expected.items():
        assert flag_values(s[name].args, "--threads") == [threads]
        assert s[name].env["OMP_NUM_THREADS"] == threads
    assert s["gateway"].env["OMP_NUM_THREADS"] == "1" and s["jobs"].env["OMP_NUM_THREADS"] == "1"


def test_plan_colocated_runs_one_worker_that_the_gateway_uses(tmp_path):
    s = by_name(up.build_plan(parse("--colocated"), tmp_path, cpus=2))
    assert [x for x in s if x not in ("redis", "jobs", "gateway")] == ["colocated"]
    assert s["colocated"].args[0] == "colocated"
    assert "--transfer-port" not in s["colocated"].args and "--transfer-backend" not in s["colocated"].args
    assert flag_values(s["gateway"].args, "--worker") == ["127.0.0.1:20051"]
    assert "--prefill" not in s["gateway"].args and "--decode" not in s["gateway"].args


def test_plan_three_prefill_two_decode(tmp_path):
    plan = up.build_plan(parse("--prefill", "3", "--decode", "2", "--worker-port", "40000"), tmp_path, cpus=2)
    s = by_name(plan)
    prefills = ["127.0.0.1:40000", "127.0.0.1:40001", "127.0.0.1:40002"]
    assert [flag_values(s[f"prefill-{i}"].args, "--port") for i in range(3)] == [["40000"], ["40001"], ["40002"]]
    assert [flag_values(s[f"decode-{i}"].args, "--port") for i in range(2)] == [["40003"], ["40004"]]
    assert [flag_values(s[f"decode-{i}"].args, "--transfer-port") for i in range(2)] == [["42003"], ["42004"]]
    for i in range(2):
        assert flag_values(s[f"decode-{i}"].args, "--prefill") == prefills
    assert flag_values(s["gateway"].args, "--prefill") == prefills
    assert flag_values(s["gateway"].args, "--decode") == ["127.0.0.1:40003", "127.0.0.1:40004"]
    ports = [u.port for x in plan.services for u in x.ports]
    assert len(ports) == len(set(ports))


def test_plan_with_external_redis_and_api_key(tmp_path):
    plan = up.build_plan(parse("--redis-url", "redis://cache:6380/2", "--api-key", "sk-secret-1",
                               "--transfer-backend", "tcp"), tmp_path / "m", cpus=2)
    s = by_name(plan)
    assert "redis" not in s
    assert flag_values(s["jobs"].args, "--redis-url") == ["redis://cache:6380/2"]
    for name in ("gateway", "jobs"):  # through the environment: a command line shows in `ps`
        assert s[name].env["PDSERVE_API_KEY"] == "sk-secret-1"
        assert not any("sk-secret-1" in a for a in s[name].args)
    assert all("PDSERVE_API_KEY" not in s[name].env for name in ("prefill", "decode"))
    assert flag_values(s["prefill"].args, "--transfer-backend") == ["tcp"]
    text = up.banner(plan, tmp_path)
    assert "Authorization: Bearer" in text and "sk-secret-1" not in text


def test_gateway_on_all_interfaces_is_reached_over_loopback(tmp_path):
    plan = up.build_plan(parse("--host", "0.0.0.0", "--port", "8080", "--api-key", "k"), tmp_path / "m", cpus=2)
    s = by_name(plan)
    assert flag_values(s["gateway"].args, "--host") == ["0.0.0.0"]
    assert plan.base_url == "http://127.0.0.1:8080/v1"
    assert flag_values(s["jobs"].args, "--gateway-url") == ["http://127.0.0.1:8080"]


def test_banner_has_base_url_and_a_runnable_curl(tmp_path):
    plan = up.build_plan(parse(), tmp_path / "SmolLM2-135M-Instruct", cpus=2)
    text = up.banner(plan, tmp_path / "logs")
    assert "OpenAI base URL: http://127.0.0.1:30000/v1" in text
    assert "curl http://127.0.0.1:30000/v1/chat/completions" in text
    assert '"model": "SmolLM2-135M-Instruct"' in text
    assert str(tmp_path / "logs") in text


@pytest.mark.parametrize("argv, message", [
    (("--colocated", "--prefill", "2"), "--colocated runs one worker"),
    (("--prefill", "0"), "--prefill must be between 1 and 64"),
    (("--decode", "65"), "--decode must be between 1 and 64"),
    (("--threads", "0"), "--threads must be at least 1"),
])
def test_bad_flags_are_refused(argv, message):
    with pytest.raises(up.UpError, match=message):
        up.validate(parse(*argv))


def test_worker_command_lines_parse_with_the_worker_cli(tmp_path):
    """Every worker command line `up` builds is accepted by `pdserve prefill|decode|colocated` itself."""
    from pdserve import cli

    for argv in ((), ("--colocated",), ("--prefill", "2", "--decode", "2", "--transfer-backend", "tcp")):
        for service in up.build_plan(parse(*argv), tmp_path, cpus=2).services:
            if service.args[0] in ("prefill", "decode", "colocated"):
                parser, command = cli.build_parser(service.args)
                parsed = parser.parse_args(service.args)
                assert command == service.args[0]
                assert parsed.threads >= 1 and parsed.http_port == parsed.port + 1000
                if command == "decode":
                    assert parsed.prefill and parsed.transfer_port == parsed.port + 2000


@pytest.mark.parametrize("role", ["gateway", "jobs"])
def test_gateway_and_jobs_command_lines_parse_with_their_cli(tmp_path, role):
    """The gateway and jobs command lines match the flags of `pdserve gateway` and `pdserve jobs`."""
    from pdserve import cli

    for argv in ((), ("--colocated", "--api-key", "k"), ("--prefill", "2", "--decode", "2")):
        service = by_name(up.build_plan(parse(*argv), tmp_path, cpus=2))[role]
        parser, command = cli.build_parser(service.args)
        parsed = parser.parse_args(service.args)
        assert command == role and parsed.port in (30000, 30010)


def test_gateway_flags_pass_through_up(tmp_path):
    from pdserve import cli

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    argv = ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25", "--chat-template", str(template),
            "--enable-cache-report", "--gateway-workers", "3")
    gateway = by_name(up.build_plan(parse(*argv), tmp_path, cpus=2))["gateway"]
    parsed = cli.build_parser(gateway.args)[0].parse_args(gateway.args)
    assert (parsed.reasoning_parser, parsed.tool_call_parser, parsed.chat_template, parsed.enable_cache_report,
            parsed.gateway_workers) == ("qwen3", "qwen25", str(template), True, 3)


# ---------------------------------------------------------------- preflight


def test_port_in_use_is_named_with_the_flag_that_moves_it(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        gateway = by_name(up.build_plan(parse("--port", str(taken)), tmp_path, cpus=2))["gateway"]
        with pytest.raises(up.UpError, match=rf"port {taken} is in use \(gateway port\).*--port"):
            up_preflight.check_ports([gateway])
    up_preflight.check_ports([gateway])  # released: accepted


def test_worker_port_in_use_names_worker_port_flag(tmp_path):
    base = free_ports(2)["worker_port"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 1 + 1000))  # the decode worker's HTTP port
        holder.listen()
        plan = up.build_plan(parse("--worker-port", str(base), "--port", "0", "--jobs-port", "0",
                                   "--redis-port", "0"), tmp_path, cpus=2)
        plan.services = [s for s in plan.services if s.name in ("prefill", "decode")]
        with pytest.raises(up.UpError, match=rf"port {base + 1001} is in use \(decode HTTP port.*--worker-port"):
            up_preflight.check_ports(plan.services)


def test_the_same_port_planned_twice_is_refused(tmp_path):
    plan = up.build_plan(parse("--port", "30500", "--jobs-port", "30500"), tmp_path, cpus=2)
    with pytest.raises(up.UpError, match=r"port 30500 is planned twice: jobs port \(--jobs-port\) and gateway port \(--port\)"):
        up_preflight.check_ports(plan.services)


def test_missing_redis_server_gives_the_install_hint(tmp_path, monkeypatch):
    plan = up.build_plan(parse(), tmp_path, cpus=2)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(up.UpError, match=r"redis-server is not installed.*apt-get install redis-server.*--redis-url"):
        up_preflight.check_executables(plan.services)


def test_substitute_of_an_unknown_service_is_refused(tmp_path):
    plan = up.build_plan(parse(), tmp_path, cpus=2)
    with pytest.raises(up.UpError, match="NAME one of redis, prefill, decode, jobs, gateway"):
        up.substitute(plan, ["router=true"])


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
    from pdserve.services.worker.cli import lora_config

    adapter = tmp_path / "sql"
    plan = up.build_plan(parse("--lora-paths", f"sql={adapter}", "--max-lora-rank", "32", "--max-loras-per-batch", "4",
                               "--lora-target-modules", "all"), tmp_path, cpus=2)
    workers = [s for s in plan.services if s.args[0] in ("prefill", "decode")]
    assert len(workers) == 2
    for service in workers:
        parser, _ = cli.build_parser(service.args)
        parsed = parser.parse_args(service.args)
        lora = lora_config(parsed)  # what the worker serves
        assert lora.paths == (("sql", str(adapter)),)
        assert (lora.max_rank, lora.max_loras_per_batch, parsed.lora_target_modules) == (32, 4, ["all"])
    plain = up.build_plan(parse("--colocated"), tmp_path, cpus=2)
    assert not any("--lora" in " ".join(s.args) for s in plain.services)


# ---------------------------------------------------------------- flags passed through


def parsed_args(args: list[str]) -> argparse.Namespace:
    """A child's command line as its own command parses it."""
    from pdserve import cli

    return cli.build_parser(args)[0].parse_args(args)


def test_every_flag_of_the_workers_gateway_and_jobs_is_taken_by_up():
    """A flag added to a service reaches `up` with no change to up: each is passed through, or `up` sets it."""
    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "up")
    accepted = {option for action in parser._actions for option in action.option_strings}
    for command, child in up_flags.child_parsers().items():
        for action in child._actions:
            missing = set(action.option_strings) - accepted - up_flags.PLANNED
            assert not missing, f"`pdserve {command}` flag {missing} is not taken by `pdserve up`"


def test_flags_reach_the_services_that_take_them_under_sglang_names(tmp_path):
    plan = up.build_plan(parse(
        "--mem-fraction-static", "0.6", "--context-length", "1024", "--max-running-requests", "7",
        "--chunked-prefill-size", "256", "--page-size", "32", "--schedule-policy", "lpm", "--dtype", "float32",
        "--log-level", "DEBUG", "--random-seed", "11", "--transfer-backend", "tcp", "--log-format", "json",
        "--max-queued-requests", "5", "--log-requests", "--retries", "1", "--served-model-name", "smol"),
        tmp_path / "m", cpus=2)
    s = by_name(plan)
    for name in ("prefill", "decode"):
        w = parsed_args(s[name].args)
        assert (w.mem_fraction, w.context_length, w.max_running_requests, w.chunked_prefill_size, w.page_size,
                w.schedule_policy, w.dtype, w.log_level, w.random_seed, w.transfer_backend, w.log_format,
                w.served_model_name) == (0.6, 1024, 7, 256, 32, "lpm", "float32", "debug", 11, "tcp", "json", "smol")
    g = parsed_args(s["gateway"].args)
    assert (g.max_queued_requests, g.log_requests, g.log_level, g.log_format) == (5, True, "debug", "json")
    j = parsed_args(s["jobs"].args)
    assert (j.retries, j.log_level, j.log_format) == (1, "debug", "json")
    # Each goes only where it is a flag, and a flag not given is not passed: the service keeps its default.
    assert "--page-size" not in s["gateway"].args and "--max-queued-requests" not in s["prefill"].args
    default = by_name(up.build_plan(parse(), tmp_path / "m", cpus=2))
    assert "--page-size" not in default["prefill"].args and "--log-level" not in default["gateway"].args


def test_the_embedding_worker_takes_only_the_flags_that_concern_it(tmp_path):
    s = by_name(up.build_plan(parse("--colocated", "--embedding-model", "minilm", "--device", "cpu", "--page-size",
                                    "32", "--log-format", "json"), tmp_path, cpus=2))
    embedding, colocated = parsed_args(s["embedding"].args), parsed_args(s["colocated"].args)
    assert (embedding.device, embedding.log_format, embedding.page_size) == ("cpu", "json", 16)
    assert (colocated.device, colocated.log_format, colocated.page_size) == ("cpu", "json", 32)


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
