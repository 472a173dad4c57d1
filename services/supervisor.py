"""Supervision of a set of local services as child processes: start in stages, watch, restart, stop.

Each child leads its own process group and logs to `<log dir>/<name>.log` (a restart appends to it), its
lines echoed with a `[name]` prefix.

Lifecycle:
- start-up: stages start in order, each healthy before the next; the first child that exits or does not
  turn healthy in time stops everything, so a caller never keeps a half-started system running.
- serving: a child that exits is restarted after a backoff (`RestartPolicy`) while the others keep serving.
  A service that keeps exiting without ever staying healthy for a while is crash-looping: then everything
  stops, and the report names it and shows the end of its log.
- stop: reverse stage order, SIGTERM to each process group, SIGKILL after a grace period.
"""
from __future__ import annotations

import collections
import http.client
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pdserve.services.jobs.cli import without_password  # the Redis health URL holds a password

LAST_LINES = 20  # lines of a failed child's log shown to the user
POLL_S = 0.2
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RestartPolicy:
    """When a service that exits after start-up is restarted, and when that is given up as a crash loop."""

    first_delay_s: float = 1.0  # before the first restart; doubles with each further exit in a row
    max_delay_s: float = 30.0  # the backoff stops growing here
    max_restarts: int = 5  # exits in a row that are restarted; the next one is a crash loop
    stable_s: float = 60.0  # healthy this long, a service's exits in a row count from zero again

    def delay(self, exits: int) -> float:
        """Seconds to wait before restarting a service after its `exits`-th exit in a row (1, 2, ...)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (exits - 1))


class UpError(RuntimeError):
    """A problem the user can fix before anything runs (port in use, missing executable, bad flag)."""


@dataclass(frozen=True)
class PortUse:
    port: int
    host: str
    what: str  # e.g. "prefill HTTP port"
    flag: str  # the flag that moves it


@dataclass
class Service:
    """One child process: how to run it, when to start it, and how to tell it is ready."""

    name: str
    launcher: list[str]  # the executable part of the command line; `--substitute` swaps only this
    args: list[str]
    stage: int
    health_url: str  # http://.../health or redis://...
    ports: list[PortUse]
    env: dict[str, str] = field(default_factory=dict)
    # Variables of the supervisor's own environment the child does not inherit (secrets it has no use for;
    # those it uses are in `env`).
    withheld: frozenset[str] = frozenset()

    @property
    def argv(self) -> list[str]:
        return self.launcher + self.args


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when the service behind `url` answers healthy: HTTP 200 on /health, or PONG from Redis."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        import redis

        try:
            with redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout) as client:
                return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
    # No proxies: every health URL is local, and an http_proxy variable must not reroute it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status == 200
    # HTTPException: e.g. a port in the ephemeral range that nothing listens on yet can connect to itself
    # and read back its own request; a failed probe must never end the supervision.
    except (OSError, ValueError, http.client.HTTPException):
        return False


class Console:
    """Serialises output from the supervisor and the children's reader threads, line by line."""

    def __init__(self, out=None, err=None) -> None:
        self._out, self._err = out or sys.stdout, err or sys.stderr
        self._lock = threading.Lock()

    def print(self, text: str, err: bool = False) -> None:
        with self._lock:
            try:
                print(text, file=self._err if err else self._out, flush=True)
            except (OSError, ValueError):  # a closed terminal must not stop the supervision
                pass


class Child:
    """One running service: its process (leader of its own process group), its log, its last lines."""

    def __init__(self, service: Service, console: Console, log_dir: Path, append: bool = False) -> None:
        self.service = service
        self.name = service.name
        self.tail: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.log_path = log_dir / f"{service.name}.log"
        self.started_at = time.monotonic()
        self.healthy_since: float | None = None  # set when its health check first passes
        self._console = console
        # A restart appends: the lines that explain the previous exit stay in the log.
        self._log = open(self.log_path, "ab" if append else "wb")
        inherited = {k: v for k, v in os.environ.items() if k not in service.withheld}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **service.env}
        try:
            # Own session: Ctrl-C reaches only `up`, which stops the children in order.
            self.proc = subprocess.Popen(service.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            self._log.close()
            raise UpError(f"cannot start {service.name} ({shlex.join(service.argv)}): {exc}") from exc
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._log.write(raw)
            self._log.flush()
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.tail.append(line)
            self._console.print(f"[{self.name}] {line}")
        self._log.close()

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def describe_exit(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def last_lines(self) -> list[str]:
        self._reader.join(timeout=2.0)  # let the reader drain what the process wrote before it died
        return list(self.tail)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Supervisor:
    """Starts services stage by stage, restarts those that die while serving, stops them all on any way out."""

    def __init__(self, services: list[Service], console: Console, log_dir: Path, startup_timeout: float = 300.0,
                 stop_timeout: float = 10.0, health: Callable[[str], bool] = probe,
                 policy: RestartPolicy = RestartPolicy()) -> None:
        self.services = services
        self.console = console
        self.log_dir = log_dir
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.health = health
        self.policy = policy
        self.children: list[Child] = []  # the latest run of each service started so far
        self._exits: dict[str, int] = {}  # service -> exits in a row without a stable run in between
        self._restart_at: dict[str, float] = {}  # service -> when its dead child is started again
        self._stop = threading.Event()
        self._force = threading.Event()
        self.reason = ""
        self.startup_failure: Child | None = None  # the child whose exit during start-up stopped everything

    def request_stop(self, reason: str) -> None:
        """Ask for an orderly stop; asked again while stopping, kill at once (signal-handler safe)."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()
        self.reason = reason

    def run(self, on_ready: Callable[[], None]) -> int:
        """Start everything, serve until stopped; 0 after a requested stop, 1 after a failed start or a crash loop."""
        try:
            for stage in sorted({s.stage for s in self.services}):
                group = [s for s in self.services if s.stage == stage]
                for service in group:
                    self._start(service)
                outcome = self._wait_healthy(group)
                if outcome is not None:
                    return outcome
            on_ready()
            return self._serve()
        except UpError as exc:
            self.console.print(f"error: {exc}", err=True)
            return 1
        finally:
            self.stop_all()

    def _start(self, service: Service) -> None:
        child = Child(service, self.console, self.log_dir)
        self.children.append(child)
        self.console.print(f"[up] started {service.name} (pid {child.proc.pid}): {shlex.join(service.argv)}")

    def _wait_healthy(self, group: list[Service]) -> int | None:
        """None once every child of the group is healthy; else the exit code `run` should return."""
        pending = [c for c in self.children if c.service in group]
        deadline = time.monotonic() + self.startup_timeout
        while pending:
            if self._stop.is_set():
                self.console.print(f"[up] {self.reason} during start-up: stopping every service", err=True)
                return 0
            dead = next((c for c in self.children if c.exited()), None)
            if dead is not None:
                self.startup_failure = dead
                self._report(dead, f"{dead.describe_exit()} before the system was ready")
                return 1
            if time.monotonic() > deadline:
                child = pending[0]
                self._report(child, f"did not become healthy within {self.startup_timeout:g} s "
                                    f"(checked {without_password(child.service.health_url)})")
                return 1
            for child in list(pending):
                if self.health(child.service.health_url):
                    pending.remove(child)
                    child.healthy_since = time.monotonic()
                    self.console.print(f"[up] {child.name} is healthy")
            if pending:
                self._stop.wait(POLL_S)
        return None

    # ------------------------------------------------------------ serving: restarts
    def _serve(self) -> int:
        """Watch the running system: 0 once a stop is asked, 1 when a service crash-loops."""
        while not self._stop.wait(POLL_S):
            for i, child in enumerate(self.children):
                if child.name in self._restart_at:
                    if time.monotonic() >= self._restart_at[child.name]:
                        self.children[i] = self._restart(child)
                elif child.exited():
                    if not self._schedule_restart(child):
                        return 1
                elif child.healthy_since is None:
                    self._check_restarted(child)
        self.console.print(f"[up] {self.reason}: stopping every service", err=True)
        return 0

    def _schedule_restart(self, child: Child) -> bool:
        """Plan the restart of a child that exited; False when it is crash-looping (everything must stop)."""
        child.signal_group(signal.SIGKILL)  # what it started itself must not hold its ports into the next run
        now = time.monotonic()
        stable = child.healthy_since is not None and now - child.healthy_since >= self.policy.stable_s
        exits = 1 if stable else self._exits.get(child.name, 0) + 1
        self._exits[child.name] = exits
        if exits > self.policy.max_restarts:
            self._report(child, f"{child.describe_exit()} and is crash-looping ({exits} exits in a row, none "
                                f"after staying healthy for {self.policy.stable_s:g} s)")
            return False
        delay = self.policy.delay(exits)
        self._restart_at[child.name] = now + delay
        self.console.print(f"[up] {child.name} {child.describe_exit()}: restarting it in {delay:g} s "
                           f"(restart {exits} of at most {self.policy.max_restarts} in a row)", err=True)
        return True

    def _restart(self, old: Child) -> Child:
        del self._restart_at[old.name]
        old.last_lines()  # the old reader is done with the log before the new run appends to it
        child = Child(old.service, self.console, self.log_dir, append=True)
        self.console.print(f"[up] restarted {child.name} (pid {child.proc.pid})")
        return child

    def _check_restarted(self, child: Child) -> None:
        """A restarted child turns healthy in time, or is killed (its exit then counts as one more in a row)."""
        if self.health(child.service.health_url):
            child.healthy_since = time.monotonic()
            self.console.print(f"[up] {child.name} is healthy again")
        elif time.monotonic() - child.started_at > self.startup_timeout:
            self.console.print(f"[up] {child.name} did not become healthy within {self.startup_timeout:g} s of "
                               f"its restart: killing it", err=True)
            child.signal_group(signal.SIGKILL)

    def _report(self, child: Child, what: str) -> None:
        lines = child.last_lines()
        text = [f"error: {child.name} {what}; stopping everything.",
                f"last {len(lines)} lines of {child.name} (full log: {child.log_path}):"]
        text += [f"  | {line}" for line in lines] or ["  | (no output)"]
        self.console.print("\n".join(text), err=True)

    def stop_all(self) -> None:
        """SIGTERM each stage's process groups (last stage first), SIGKILL what outlives the grace period."""
        for stage in sorted({c.service.stage for c in self.children}, reverse=True):
            group = [c for c in self.children if c.service.stage == stage]
            for child in group:
                if not child.exited():
                    child.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            while any(not c.exited() for c in group) and time.monotonic() < deadline and not self._force.is_set():
                time.sleep(0.05)
            for child in group:
                if not child.exited():
                    self.console.print(f"[up] {child.name} did not stop within {self.stop_timeout:g} s: killing it",
                                       err=True)
                # Also reaches what the child started itself and left behind.
                child.signal_group(signal.SIGKILL)
                child.proc.wait()
        for child in self.children:
            child.last_lines()
