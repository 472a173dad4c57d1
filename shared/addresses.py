"""HOST:PORT lists where a host may be a DNS name for several machines (compose/Kubernetes services)."""
from __future__ import annotations

import ipaddress
import socket


def split_hostport(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {spec!r}")
    return host.strip("[]"), int(port)


def expand_hostports(spec: str) -> list[str]:
    """Every IPv4 address `spec`'s host name resolves to, as HOST:PORT (the spec itself for IPs and localhost)."""
    host, port = split_hostport(spec)
    try:
        ipaddress.ip_address(host)
        return [spec]
    except ValueError:
        pass
    if host == "localhost":
        return [spec]
    try:
        infos = socket.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return [spec]
    return [f"{a}:{port}" for a in sorted({info[4][0] for info in infos})] or [spec]
