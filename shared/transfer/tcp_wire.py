"""The TCP transfer's wire: the handshake each connection opens with, and the framing of a message.

Handshake: the receiver sends CHALLENGE (magic, random nonce), the sender answers with HMAC-SHA256(cluster
token, nonce), and the receiver ACKs it or refuses and closes (cluster_auth.py: the token itself never crosses
the wire).

Message: HEADER (magic, page_bytes, number of runs, the fence of the reservation it fills: fence.py), the runs as (dst_start, pages) pairs, then the runs' bytes
back to back; the receiver answers ACK (status 0 = stored; else an error message follows and it closes the
connection). An empty message (no runs) is the liveness check `TcpTransfer.add_peer` uses. A message of some
of each page's KV heads (tensor-parallel peers) has the magic HEADS_MAGIC, the bytes of those heads of one
page in place of page_bytes, and HEAD_RANGE (the destination heads [lo, hi)) after the header; its bytes are
each run's pages with only those heads, [pages, layers, 2, page_size, heads, head_dim] contiguous.
"""
from __future__ import annotations

import socket
import struct

from pdserve.shared import cluster_auth
from pdserve.shared.transfer.base import Run, TransferError

MAGIC = b"PDK2"  # version 2: messages carry their fence
HEADS_MAGIC = b"PDH2"
CHALLENGE = struct.Struct(f"!4s{cluster_auth.CHALLENGE_BYTES}s")  # magic, nonce
HEADER = struct.Struct("!4sQIQ")  # magic, page_bytes, number of runs, fence
RUN = struct.Struct("!QQ")  # dst_start page, number of pages
HEAD_RANGE = struct.Struct("!II")  # the destination heads [lo, hi) of a HEADS_MAGIC message
ACK = struct.Struct("!BI")  # status (0 = ok), length of the error message that follows


def recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        view = view[n:]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def message_head(page_bytes: int, runs: list[Run], fence: int, heads: tuple[int, int] | None = None) -> bytes:
    """What precedes a message's page bytes: its header and where each run goes (and into which heads)."""
    if heads is None:
        head = HEADER.pack(MAGIC, page_bytes, len(runs), fence)
    else:
        head = HEADER.pack(HEADS_MAGIC, page_bytes, len(runs), fence) + HEAD_RANGE.pack(*heads)
    return head + b"".join(RUN.pack(r.dst_start, r.length) for r in runs)


def read_runs(conn: socket.socket, count: int) -> list[tuple[int, int]]:
    """A message's runs as (dst_start, pages), once its header said how many."""
    return list(RUN.iter_unpack(recv_exact(conn, count * RUN.size)))


def acknowledge(conn: socket.socket) -> None:
    conn.sendall(ACK.pack(0, 0))


def refuse(conn: socket.socket, error: str) -> None:
    conn.sendall(ACK.pack(1, len(error.encode())) + error.encode())


def expect_ack(sock: socket.socket, what: str) -> None:
    """The receiver's answer: TransferError with its message when it refused."""
    status, length = ACK.unpack(recv_exact(sock, ACK.size))
    if status != 0:
        raise TransferError(f"{what}: the peer refused: {recv_exact(sock, length).decode()}")


# ------------------------------------------------------------ handshake
def prove(sock: socket.socket, token: str | None, what: str) -> None:
    """The sender's side: answer the receiver's challenge on a new connection."""
    magic, nonce = CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size))
    if magic != MAGIC:
        raise TransferError(f"{what}: the peer does not speak the KV transfer protocol")
    sock.sendall(cluster_auth.proof(token, nonce))
    expect_ack(sock, what)


def admit(conn: socket.socket, token: str | None, timeout: float) -> bool:
    """The receiver's side: whether the sender proved within `timeout` that it holds the cluster token."""
    nonce = cluster_auth.challenge()
    conn.settimeout(timeout)
    conn.sendall(CHALLENGE.pack(MAGIC, nonce))
    if not cluster_auth.proves(token, nonce, recv_exact(conn, cluster_auth.PROOF_BYTES)):
        refuse(conn, f"the sender does not hold this cluster's token ({cluster_auth.TOKEN_ENV})")
        return False
    acknowledge(conn)
    return True
