"""The batch workers `pdserve jobs --batch-workers N` runs as child processes.

Lifecycle: start N `pdserve batch-worker` processes -> restart any that exits while the service runs
(after a short pause, so a worker that cannot start does not spin) -> on shutdown SIGTERM each, SIGKILL
after a grace period. Children watch their parent's pid and exit if the service dies without stopping them.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("pdserve.jobs")
RESTART_PAUSE_S = 1.0
STOP_GRACE_S = 5.0


@dataclass
class WorkerChildren:
    count: int
    args: list[str]  # flags for `pdserve batch-worker`
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self) -> subprocess.Popen:
        argv = [sys.executable, "-m", "pdserve", "batch-worker", *self.args, "--parent-pid", str(os.getpid())]
        return subprocess.Popen(argv, env={**os.environ, **self.env})

    def start(self) -> WorkerChildren:
        self.procs = [self.spawn() for _ in range(self.count)]
        if self.count:
            log.info("started %d batch worker(s): pids %s", self.count, [p.pid for p in self.procs])
        return self

    async def supervise(self, stop: asyncio.Event) -> None:
        exited_at: dict[int, float] = {}
        while not stop.is_set():
            for i, proc in enumerate(self.procs):
                if proc.poll() is None:
                    continue
                first = exited_at.setdefault(i, time.monotonic())
                if time.monotonic() - first >= RESTART_PAUSE_S:
                    log.warning("batch worker pid %d exited with %s; restarting it", proc.pid, proc.returncode)
                    self.procs[i] = self.spawn()
                    exited_at.pop(i)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
