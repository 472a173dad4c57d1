"""What `pdserve up` checks before anything starts: every executable present, every port free, and the workers'
block of ports chosen outside the kernel's ephemeral range, where an outgoing connection cannot hold one a
moment before a worker binds it.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Callable

from pdserve.services.supervisor import PortUse, Service, UpError

# The first worker's gRPC port unless --worker-port is given: with its +1000 and +2000 ports below Linux's
# default ephemeral range (32768-60999), so an outgoing connection never holds one of them a moment before
# the worker binds it.
DEFAULT_WORKER_PORT = 20051
WORKER_PORT_OFFSETS = (0, 1000, 2000)  # gRPC, HTTP, KV transfer (a decode worker's)
WORKER_BASE_STEP = 100  # the next block tried when one is taken
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Where the kernel does not say: Linux's default and the IANA range (macOS, BSD) together.
FALLBACK_EPHEMERAL = range(32768, 65536)


def port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Servers set SO_REUSEADDR too, so a port only in TIME_WAIT counts as free, as it is for them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(services: list[Service]) -> None:
    """Mistakes in the plan first, then ports something else holds (the answer to those may change)."""
    uses = [u for s in services for u in s.ports]
    seen: dict[int, PortUse] = {}
    for use in uses:
        if not 0 < use.port < 65536:
            raise UpError(f"port {use.port} ({use.what}) is out of range: choose another with {use.flag}")
        if use.port in seen:
            other = seen[use.port]
            raise UpError(f"port {use.port} is planned twice: {other.what} ({other.flag}) and {use.what} "
                          f"({use.flag})")
        seen[use.port] = use
    for use in uses:
        if port_in_use(use.host, use.port):
            raise UpError(f"port {use.port} is in use ({use.what}): stop what holds it or choose another port "
                          f"with {use.flag}")


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> range:
    """The local ports the kernel hands to outgoing connections (`ip_local_port_range`)."""
    try:
        low, high = map(int, path.read_text().split())
    except (OSError, ValueError):
        return FALLBACK_EPHEMERAL
    return range(low, high + 1)


def worker_block(base: int, count: int) -> list[int]:
    return [base + i + offset for i in range(count) for offset in WORKER_PORT_OFFSETS]


def choose_worker_base(count: int, ephemeral: range, reserved: set[int], is_free: Callable[[int], bool],
                       start: int = DEFAULT_WORKER_PORT) -> int:
    """The first worker gRPC port, from `start` up in steps of WORKER_BASE_STEP (then below `start`, down), whose
    block of `count` consecutive gRPC ports (each port, +1000, +2000: a tensor-parallel decode worker takes as
    many as its ranks, for their KV ports) lies outside `ephemeral`, holds none of `reserved` (the gateway, jobs
    and Redis ports) and is free now."""
    top = 65535 - max(WORKER_PORT_OFFSETS) - count + 1
    upward = range(start, top + 1, WORKER_BASE_STEP)
    downward = range(start - WORKER_BASE_STEP, 1024, -WORKER_BASE_STEP)
    for base in (*upward, *downward):
        block = worker_block(base, count)
        if any(p in ephemeral or p in reserved for p in block):
            continue
        if all(is_free(p) for p in block):
            return base
    raise UpError(f"no free block of {count} worker ports (each +1000 and +2000) outside the ephemeral range "
                  f"{ephemeral.start}-{ephemeral.stop - 1}: choose one with --worker-port")


def check_executables(services: list[Service]) -> None:
    for service in services:
        exe = service.launcher[0]
        if shutil.which(exe) is None and not os.access(exe, os.X_OK):
            if service.name == "redis":
                raise UpError("redis-server is not installed: install it (Debian/Ubuntu: `sudo apt-get install "
                              "redis-server`; macOS: `brew install redis`) or pass --redis-url to use a running Redis")
            raise UpError(f"cannot run {service.name}: {exe!r} not found")
