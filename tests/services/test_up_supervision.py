"""Supervision after start-up: a service that dies is restarted with backoff while the rest keeps serving;
one that crash-loops stops everything, named, with the end of its log.

The Supervisor tests run tiny real child processes (an HTTP /health server each) under a fast RestartPolicy;
the last test runs the real `pdserve up --decode 2` with the stand-ins of test_up.py and the default policy.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve.services.supervisor import Console, PortUse, RestartPolicy, Service, Supervisor
from procs import free_port
from test_up import get, pids_alive, run_up  # noqa: F401 (run_up is a fixture)

CHILD = r'''
import http.server, os, sys, threading, time
port, die_when = int(sys.argv[1]), sys.argv[2]

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
print("serving", flush=True)
while not os.path.exists(die_when):
    time.sleep(0.05)
print("dying now", flush=True)
sys.exit(3)
'''

FAST = RestartPolicy(first_delay_s=0.2, max_delay_s=0.4, max_restarts=3, stable_s=1.5)


class Output:
    """What the supervisor prints (both streams), line by line, readable while it runs."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines += [line for line in text.splitlines() if line]

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 20.0) -> re.Match:
        """The first line matching `pattern` from line `after` on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.text}")


class Running:
    """A Supervisor over `names` (one stage each), run on a thread as `up` runs it."""

    def __init__(self, tmp_path: Path, names: list[str], policy: RestartPolicy) -> None:
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        self.trigger = {name: tmp_path / f"{name}.die" for name in names}
        services = []
        for stage, name in enumerate(names):
            port = free_port()
            services.append(Service(name, [sys.executable, str(script)], [str(port), str(self.trigger[name])],
                                    stage, f"http://127.0.0.1:{port}/health",
                                    [PortUse(port, "127.0.0.1", f"{name} port", "--port")]))
        self.out = Output()
        self.log_dir = tmp_path / "logs"
        self.log_dir.mkdir()
        self.supervisor = Supervisor(services, Console(self.out, self.out), self.log_dir, startup_timeout=20,
                                     stop_timeout=5, policy=policy)
        self.ready = threading.Event()
        self.code: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.ready.wait(30), self.out.text

    def _run(self) -> None:
        self.code = self.supervisor.run(on_ready=self.ready.set)

    def pid(self, name: str) -> int:
        return next(c.proc.pid for c in self.supervisor.children if c.name == name)

    def wait_exit(self, timeout: float = 30.0) -> int | None:
        self._thread.join(timeout)
        return self.code

    def close(self) -> None:
        self.supervisor.request_stop("test over")
        self._thread.join(30)


@pytest.fixture
def supervise(tmp_path):
    runs: list[Running] = []

    def start(names: list[str], policy: RestartPolicy = FAST) -> Running:
        runs.append(Running(tmp_path, names, policy))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def kill_and_wait_back(run: Running, name: str) -> int:
    """SIGKILL `name`, wait until its restart is healthy; the line number of the restart notice."""
    mark = len(run.out.lines)
    os.kill(run.pid(name), signal.SIGKILL)
    run.out.wait_for(rf"^\[up\] {name} is healthy again", after=mark)
    return next(i for i in range(mark, len(run.out.lines)) if "restarting it in" in run.out.lines[i])


def test_restart_backoff_doubles_up_to_its_cap():
    assert [RestartPolicy().delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_killed_service_is_restarted_with_backoff_while_the_others_keep_serving(supervise):
    run = supervise(["steady", "flaky"])
    steady = run.pid("steady")
    first = run.pid("flaky")
    at = kill_and_wait_back(run, "flaky")
    assert run.out.lines[at] == ("[up] flaky was killed by SIGKILL: restarting it in 0.2 s "
                                 "(restart 1 of at most 3 in a row)")
    second = run.pid("flaky")
    assert second != first and pids_alive([first]) == []
    assert get(run.supervisor.children[1].service.health_url) == 200
    # Killed again before it stayed healthy for stable_s: the next restart waits twice as long.
    at = kill_and_wait_back(run, "flaky")
    assert "restarting it in 0.4 s (restart 2 of at most 3 in a row)" in run.out.lines[at]
    # Healthy for longer than stable_s: the count starts over.
    time.sleep(FAST.stable_s + 0.3)
    at = kill_and_wait_back(run, "flaky")
    assert "restarting it in 0.2 s (restart 1 of at most 3 in a row)" in run.out.lines[at]
    # The other service never noticed; every run of flaky wrote to the same log.
    assert run.pid("steady") == steady and pids_alive([steady]) == [steady]
    assert (run.log_dir / "flaky.log").read_text().count("serving") == 4
    pids = [steady, run.pid("flaky")]
    run.supervisor.request_stop("SIGTERM")
    assert run.wait_exit() == 0
    assert pids_alive(pids) == []
    assert "error:" not in run.out.text


def test_a_crash_looping_service_stops_everything_and_shows_its_last_lines(supervise):
    run = supervise(["steady", "flaky"])
    steady = run.pid("steady")
    run.trigger["flaky"].touch()  # from now on every run of flaky exits as soon as it started
    started = time.monotonic()
    assert run.wait_exit() == 1
    assert time.monotonic() - started < 10  # 0.2 + 0.4 + 0.4 s of backoff, and three short runs
    out = run.out.text
    assert [re.search(r"restarting it in (\S+) s", line).group(1) for line in run.out.lines
            if "restarting it in" in line] == ["0.2", "0.4", "0.4"]
    assert ("error: flaky exited with code 3 and is crash-looping (4 exits in a row, none after staying healthy "
            "for 1.5 s); stopping everything.") in out
    report = out[out.index("crash-looping"):]
    assert f"(full log: {run.log_dir / 'flaky.log'})" in report
    assert report.splitlines()[-2:] == ["  | serving", "  | dying now"]  # the last run's own lines
    assert pids_alive([steady]) == []


def test_up_restarts_a_killed_decode_worker_while_the_other_keeps_serving(run_up):  # noqa: F811
    stand_ins = {"prefill": "", "decode-0": "", "decode-1": "", "jobs": "", "gateway": ""}
    run = run_up("--decode", "2", substitute=stand_ins, workers=3)
    run.wait_for("OpenAI base URL")
    pids = run.child_pids()
    others = [pid for name, pid in pids.items() if name != "decode-0"]
    os.killpg(pids["decode-0"], signal.SIGKILL)
    notice = run.wait_for(r"^\[up\] decode-0 was killed by SIGKILL: restarting it in 1 s")
    restarted = int(run.wait_for(r"^\[up\] restarted decode-0 \(pid (\d+)\)").group(1))
    try:
        run.wait_for(r"^\[up\] decode-0 is healthy again", timeout=30)
        assert "(restart 1 of at most 5 in a row)" in notice.string
        assert run.proc.poll() is None and sorted(pids_alive(others)) == sorted(others)
        assert get(f"http://127.0.0.1:{run.ports['port']}/health") == 200
        assert len(re.findall(r"^\[decode-0\] serving", run.output, re.M)) == 2
        assert "stopping every" not in run.output and "error:" not in run.output
        started = time.monotonic()
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait_exit(30) == 0
        assert time.monotonic() - started < 10
        assert pids_alive(others + [restarted]) == []
    finally:
        if pids_alive([restarted]):
            os.killpg(restarted, signal.SIGKILL)
