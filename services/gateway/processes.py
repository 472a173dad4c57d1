"""Several gateway processes on one port (--gateway-workers N): a small parent that starts N children and ends
with them.

Lifecycle: the parent checks that nothing listens on the port, makes a private directory (mode 0700) for the
children's metrics files (`metrics/`, PROMETHEUS_MULTIPROC_DIR, see metrics.py) and sockets (siblings.py), and
starts the children with multiprocessing's spawn context, handing each the parsed flags in memory: the API keys
never reach a command line. Each child builds the app and listens on the same host:port with SO_REUSEPORT, so
the kernel spreads connections over them. SIGTERM or SIGINT to the parent goes on to every child, which drains
(--drain-timeout) and exits; the parent exits once all have, and removes the directory.

A child that exits on its own (a crash, a failed start) makes the parent stop the others and exit non-zero. It
is not restarted here: an orchestrator (Kubernetes, `pdserve up`) then sees the failure and restarts the gateway
whole, where a restart loop in here would hide a crashing process behind a port that still answers. A child
whose parent is gone (killed with SIGKILL) drains and exits as on SIGTERM, so no orphan keeps the port, and the
last of them to exit removes the private directory, which the parent can no longer remove: each child holds a
shared flock on `alive.lock` there while it runs (`join`), and one that can then take it exclusively is the last.
"""
from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from multiprocessing.connection import wait
from typing import Callable

log = logging.getLogger("pdserve.gateway")
METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when first imported
PARENT_CHECK_S = 1.0  # how often a child checks that its parent is still there


def supervise(args: argparse.Namespace, child: Callable[[argparse.Namespace, int, str], None]) -> int:
    """Run `child(args, index, directory)` (index 1 to N; the private directory) in N processes until they end;
    the gateway's exit status."""
    count = args.gateway_workers
    try:
        check_free(args.host, args.port)
    except OSError as exc:
        log.error("cannot listen on %s:%d (%s); pass --port", args.host, args.port, exc)
        return 1
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pdserve-gateway-") as directory:
        os.environ[METRICS_DIR] = os.path.join(directory, "metrics")  # inherited before prometheus_client loads
        os.mkdir(os.environ[METRICS_DIR])
        children = [spawn.Process(target=child, args=(args, i, directory), name=f"gateway-{i}")
                    for i in range(1, count + 1)]
        stopping = False

        def stop(signum: int | None = None, frame: object = None) -> None:
            nonlocal stopping
            stopping = True
            for process in children:
                if process.pid is not None and process.exitcode is None:
                    os.kill(process.pid, signal.SIGTERM)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        for process in children:
            process.start()
        if stopping:  # a signal came while they started: those started after it have not heard it
            stop()
        log.info("gateway: %d processes (pids %s) serve http://%s:%d", count,
                 ", ".join(str(p.pid) for p in children), args.host, args.port)
        code, running = 0, list(children)
        while running:
            ended = set(wait([p.sentinel for p in running]))
            for process in [p for p in running if p.sentinel in ended]:
                process.join()
                running.remove(process)
                if not stopping:
                    log.error("gateway process %s (pid %d) exited with status %s: stopping the others",
                              process.name, process.pid, process.exitcode)
                    code = process.exitcode if process.exitcode and process.exitcode > 0 else 1
                    stop()
                elif process.exitcode and process.exitcode > 0 and not code:
                    code = process.exitcode  # it failed as it stopped (a signal we sent ends it quietly)
        return code


def check_free(host: str, port: int) -> None:
    """OSError when something listens on host:port. The children bind with SO_REUSEPORT, which would let them
    share the port with another gateway started the same way; this bind, without it, fails instead."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.create_server((host, port), family=family):
        pass


async def watch_parent(stop: asyncio.Event) -> None:
    """Set `stop` when the process that started this one is gone (it was killed without passing the signal on)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    log.warning("the gateway's parent process %d is gone: stopping", parent)
    stop.set()


def join(directory: str) -> int:
    """Count this child among the gateway's running processes until `leave` (a shared lock, held by its file
    descriptor: the kernel lets go of it however the process ends)."""
    fd = os.open(os.path.join(directory, "alive.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def leave(directory: str, fd: int, orphaned: bool) -> None:
    """This child has stopped. `orphaned` (its parent was killed): the last child out removes the directory."""
    os.close(fd)
    if not orphaned:
        return  # the parent removes it once every child has ended
    try:
        fd = os.open(os.path.join(directory, "alive.lock"), os.O_RDWR)
    except FileNotFoundError:
        return  # a sibling that left at the same moment removed it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # a sibling still runs: the last one removes it
    finally:
        os.close(fd)
    log.info("the gateway's last process removes its private directory %s", directory)
    shutil.rmtree(directory, ignore_errors=True)
