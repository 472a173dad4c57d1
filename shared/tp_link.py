"""Liveness between the nodes of a tensor-parallel worker: is the other machine's side still there?

Rank 0's engine process listens on a port of its own (published in the rendezvous store); each other node's
process connects once, says its node number, and from then on both ends send a beat (a newline) every BEAT_S.
A node is gone for the other end when its connection closes (its process died: the kernel closes the socket, so
this is noticed within a beat), when it says why before it leaves (a line of text: "rank 3 exited (code 1)"), or
when nothing came from it for `timeout_s` (--dist-timeout: a machine that vanished or hangs).

Inside a step the collectives notice a lost peer themselves (a closed connection at once, a silent one after
--dist-timeout); this link is what notices it between steps, when an idle worker makes no collective call.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time

from pdserve.shared.tp_group import RankGone

log = logging.getLogger(__name__)
BEAT_S = 0.5
HELLO_TIMEOUT_S = 2.0


class _Peer:
    def __init__(self, node: int, sock: socket.socket, where: str) -> None:
        self.node, self.sock, self.where = node, sock, where
        self.heard = time.monotonic()
        self.partial = b""


class Link:
    """One end of the liveness links: rank 0's (`listen`, every other node a peer) or a node's (`connect`, rank
    0's node its one peer). `poll` beats and listens; `lost` says which peer is gone and why, for good."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.peers: dict[int, _Peer] = {}
        self.lost: str | None = None
        self.listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._last_beat = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------ the two ends
    @classmethod
    def listen(cls, timeout_s: float) -> Link:
        """Rank 0's end, on a free port of every interface; `start()` runs it on a thread of its own."""
        link = cls(timeout_s)
        link.listener = socket.create_server(("", 0))
        link.listener.setblocking(False)
        link._selector.register(link.listener, selectors.EVENT_READ)
        return link

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    @classmethod
    def connect(cls, host: str, port: int, node: int, timeout_s: float) -> Link:
        """A node's end: connected to rank 0's, which now knows this node."""
        link = cls(timeout_s)
        try:
            sock = socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S)
        except OSError as exc:
            raise RankGone(f"node {node}: cannot reach rank 0's node at {host}:{port}: {exc}") from None
        sock.sendall(f"{node}\n".encode())
        link._add(_Peer(0, sock, f"{host}:{port}"))
        return link

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tp-link", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                self.poll(BEAT_S)
            except (OSError, ValueError):  # closed under us
                if not self._closed:
                    raise

    def linked(self, nodes) -> bool:
        return all(n in self.peers for n in nodes)

    def check(self) -> None:
        if self.lost is not None:
            raise RankGone(self.lost)

    # ------------------------------------------------------------ beats and word
    def poll(self, wait_s: float) -> None:
        """Wait up to `wait_s` for word from the peers (or a node connecting), beat when one is due, and note a
        peer that is gone."""
        for key, _ in self._selector.select(wait_s):
            if key.fileobj is self.listener:
                self._accept()
            else:
                self._read(key.data)
        now = time.monotonic()
        if now - self._last_beat >= BEAT_S:
            self._last_beat = now
            self._send(b"\n")
        for peer in list(self.peers.values()):
            if now - peer.heard > self.timeout_s:
                self._lose(peer, f"no word from it for {self.timeout_s:g} s (--dist-timeout)")

    def say(self, reason: str) -> None:
        """Tell the peers why this end is leaving (before it closes)."""
        self._send(reason.replace("\n", " ").encode() + b"\n")

    def close(self) -> None:
        self._closed = True
        for peer in list(self.peers.values()):
            peer.sock.close()
        if self.listener is not None:
            self.listener.close()
        self._selector.close()

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except BlockingIOError:
            return
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = sock.recv(64).split(b"\n")[0]
            node = int(hello)
        except (OSError, ValueError):
            sock.close()
            return
        if node in self.peers or node < 1:
            sock.sendall(f"node {node} is already part of this worker\n".encode())
            sock.close()
            return
        log.info("tensor-parallel node %d linked from %s", node, addr[0])
        self._add(_Peer(node, sock, addr[0]))

    def _add(self, peer: _Peer) -> None:
        peer.sock.setblocking(False)
        self.peers[peer.node] = peer
        self._selector.register(peer.sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lose(peer, f"its connection failed ({exc})")
            return
        if not data:
            self._lose(peer, "its connection closed")
            return
        peer.heard = time.monotonic()
        lines = (peer.partial + data).split(b"\n")
        peer.partial = lines.pop()
        said = [line.decode(errors="replace") for line in lines if line.strip()]
        if said:
            self._lose(peer, said[0])

    def _send(self, data: bytes) -> None:
        for peer in list(self.peers.values()):
            try:
                peer.sock.send(data)
            except BlockingIOError:
                pass  # its buffer is full of beats it has not read: it is slow, not gone
            except OSError as exc:
                self._lose(peer, f"its connection failed ({exc})")

    def _lose(self, peer: _Peer, why: str) -> None:
        self.peers.pop(peer.node, None)
        self._selector.unregister(peer.sock)
        peer.sock.close()
        what = "rank 0's node" if peer.node == 0 else f"tensor-parallel node {peer.node}"
        if self.lost is None:
            self.lost = f"{what} ({peer.where}) is gone: {why}"
