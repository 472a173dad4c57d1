"""`pdserve up` keeps its secrets off command lines: what `ps` shows of every process it starts, and what it
prints, never holds the API key or a Redis password. The services get them in their environment."""
from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.services import up
from test_up import ALL_STAND_INS, UpRun, by_name, flag_values, free_ports, parse

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
    finally:
        run.close()


def test_a_redis_url_with_a_password_reaches_jobs_only_in_its_environment(tmp_path):
    url = f"redis://:{PASSWORD}@cache:6380/2"
    jobs = by_name(up.build_plan(parse("--redis-url", url), tmp_path, 2))["jobs"]
    assert jobs.env["PDSERVE_REDIS_URL"] == url
    assert not any(PASSWORD in a for a in jobs.argv) and flag_values(jobs.args, "--redis-url") == []


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
    plans = [by_name(up.build_plan(parse("--prefill", "1", "--decode", "2"), tmp_path, 2)) for _ in range(2)]
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
    gateway = by_name(up.build_plan(parse(), tmp_path, 2))["gateway"]
    assert gateway.env["PDSERVE_CLUSTER_TOKEN"] == "given-token-for-a-fleet"
