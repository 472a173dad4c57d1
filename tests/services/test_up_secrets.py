"""`pdserve up` keeps its secrets off command lines: what `ps` shows of every process it starts, and what it
prints, never holds the API key or a Redis password. The services get them in their environment, each only the
ones it uses. The Redis it starts requires a password generated per run, and it serves beyond loopback only
with an API key or when told --allow-insecure."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pdserve.services import up, up_flags, up_plan
from pdserve.services.supervisor import Console, Service, Supervisor
from test_up import ALL_STAND_INS, UpRun, free_ports, get
from up_plans import by_name, flag_values, parse

KEY = "sk-up-secret-3f9a1c"
PASSWORD = "redis-pw-51c7e2"


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_the_api_key_is_in_no_command_line_of_the_running_system(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)  # `up`'s own command line holds no key either
    run = UpRun(tmp_path, substitute=ALL_STAND_INS)
    try:
        run.wait_for(r"OpenAI base URL: http://127\.0\.0\.1:\d+/v1")
        pids = run.child_pids()
        assert sorted(pids) == ["decode", "gateway", "jobs", "prefill", "redis"]
        for name, pid in [("up", run.proc.pid), *pids.items()]:
            assert KEY not in cmdline(pid), name
        for name in ("gateway", "jobs"):
            assert environ(pids[name])["PDSERVE_API_KEY"] == KEY
        assert KEY not in run.output  # the lines `up` printed, each child's command line among them
        # Redis's password of this run: in a file only this user reads, and in the environment of the services that
        # use Redis alone (jobs, and the gateway for its stored responses).
        config = run.state / "redis.conf"
        assert config.stat().st_mode & 0o777 == 0o600
        password = re.fullmatch(r'requirepass "(\S+)"\n', config.read_text()).group(1)
        assert len(password) >= 32
        assert urlsplit(environ(pids["jobs"])["PDSERVE_REDIS_URL"]).password == password
        assert urlsplit(environ(pids["gateway"])["PDSERVE_REDIS_URL"]).password == password
        for name, pid in [("up", run.proc.pid), *pids.items()]:
            assert password not in cmdline(pid), name
            if name not in ("jobs", "gateway"):
                assert password not in " ".join(environ(pid).values()), name
        for name in ("prefill", "decode"):  # workers get neither the API key nor Redis
            assert not {"PDSERVE_API_KEY", "PDSERVE_REDIS_URL"} & set(environ(pids[name])), name
        assert password not in run.output
        assert password not in "".join(p.read_text() for p in (run.state / "logs").glob("*.log"))
    finally:
        run.close()


def test_a_redis_health_url_is_shown_without_its_password(tmp_path):
    lines = []

    class Recorder(Console):
        def print(self, text: str, err: bool = False) -> None:
            lines.append(text)

    url = f"redis://:{PASSWORD}@127.0.0.1:1/0"
    service = Service("redis", [sys.executable, "-c", "import time; time.sleep(30)"], [], 0, url, [])
    supervisor = Supervisor([service], Recorder(), tmp_path, startup_timeout=0.3, stop_timeout=1.0,
                            health=lambda u: False)
    assert supervisor.run(on_ready=lambda: None) == 1
    assert "(checked redis://:***@127.0.0.1:1/0)" in "\n".join(lines)
    assert PASSWORD not in "\n".join(lines)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "my-host.example"])
def test_serving_beyond_loopback_needs_a_key_or_allow_insecure(host):
    with pytest.raises(up.UpError) as info:
        up_flags.validate(parse("--host", host, "--api-key", ""))
    message = str(info.value)
    assert f"--host {host}" in message and "PDSERVE_API_KEY" in message and "--api-key" in message
    assert "--allow-insecure" in message
    up_flags.validate(parse("--host", host, "--api-key", KEY))
    up_flags.validate(parse("--host", host, "--api-key", "", "--allow-insecure"))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_the_keyless_quick_start_on_loopback_stays(host):
    up_flags.validate(parse("--host", host, "--api-key", ""))
    assert not up_flags.exposed_without_key(parse("--host", host, "--api-key", ""))


def test_up_on_all_interfaces_without_a_key_refuses_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--host", "0.0.0.0", "--state-dir",
                             str(tmp_path / "state"), "--model-path", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "error: --host 0.0.0.0 serves the API beyond this machine with no API key" in result.stderr
    assert "--allow-insecure" in result.stderr and "started" not in result.stdout


def test_up_with_allow_insecure_serves_on_all_interfaces_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    run = UpRun(tmp_path, "--host", "0.0.0.0", "--allow-insecure", substitute=ALL_STAND_INS)
    try:
        run.wait_for(r"OpenAI base URL: http://127\.0\.0\.1:\d+/v1")
        port = run.ports["port"]
        assert f"[up] warning: the gateway listens on 0.0.0.0 with no API key (--allow-insecure): anyone who can " \
               f"reach port {port} can use it" in run.output
        assert get(f"http://127.0.0.1:{port}/health") == 200
    finally:
        run.close()


def test_a_redis_url_with_a_password_reaches_jobs_and_the_gateway_only_in_their_environment(tmp_path):
    url = f"redis://:{PASSWORD}@cache:6380/2"
    jobs = by_name(up_plan.build_plan(parse("--redis-url", url), tmp_path, 2))["jobs"]
    assert jobs.env["PDSERVE_REDIS_URL"] == url
    assert not any(PASSWORD in a for a in jobs.argv) and flag_values(jobs.args, "--redis-url") == []
    gateway = by_name(up_plan.build_plan(parse("--redis-url", url), tmp_path, 2))["gateway"]  # its stored responses
    assert gateway.env["PDSERVE_REDIS_URL"] == url
    assert not any(PASSWORD in a for a in gateway.argv) and flag_values(gateway.args, "--redis-url") == []


def test_an_unreachable_redis_is_reported_without_its_password(tmp_path):
    ports = free_ports(2)
    args = parse("--redis-url", f"redis://:{PASSWORD}@127.0.0.1:1/0", "--model-path", str(tmp_path),
                 *(a for k, v in ports.items() for a in (f"--{k.replace('_', '-')}", str(v))),
                 state_dir=str(tmp_path / "state"))
    with pytest.raises(up.UpError, match=r"redis://:\*\*\*@127\.0\.0\.1:1/0") as info:
        up.prepare(args)
    assert PASSWORD not in str(info.value)


def test_every_worker_and_the_gateway_share_one_new_cluster_token_per_run(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN", raising=False)
    plans = [by_name(up_plan.build_plan(parse("--prefill", "1", "--decode", "2"), tmp_path, 2)) for _ in range(2)]
    tokens = []
    for services in plans:
        holders = {name: s.env.get("PDSERVE_CLUSTER_TOKEN") for name, s in services.items()}
        assert set(holders) >= {"prefill", "decode-0", "decode-1", "gateway"}
        shared = {holders[n] for n in ("prefill", "decode-0", "decode-1", "gateway")}
        assert len(shared) == 1 and len(next(iter(shared))) >= 32
        assert holders["jobs"] is None  # jobs talks to the gateway only
        tokens.append(shared.pop())
        assert not any(tokens[-1] in a for s in services.values() for a in s.argv)
    assert tokens[0] != tokens[1]
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "given-token-for-a-fleet")
    gateway = by_name(up_plan.build_plan(parse(), tmp_path, 2))["gateway"]
    assert gateway.env["PDSERVE_CLUSTER_TOKEN"] == "given-token-for-a-fleet"
