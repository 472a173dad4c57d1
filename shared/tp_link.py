"""Liveness between the nodes of a tensor-parallel worker: is the other machine's side still there?

Rank 0's engine process listens on a port of its own on --dist-init-addr's address (published in the rendezvous
store); each other node's process connects once, claims its node number, and from then on both ends send a beat
(a newline) every BEAT_S. Rank 0 grants each number of its worker's other nodes once: a claim of a number outside
them, or of one already linked, is refused (the node's `NodeClaimError` names the address that holds it). An
accept that fails for want of descriptors (EMFILE) pauses the listening only (shared/tp_gate.py `Door`).

The hello: rank 0's end sends a random challenge (hex, a line); the node answers its number and HMAC-SHA256(cluster
token, challenge + number) (hex, a line); rank 0's end answers "linked", or why not and closes. Without a cluster
token any answer will do, as on the workers' other ports (shared/cluster_auth.py); with one, a connection that
does not prove it is refused and logged with its address, never counted as a node nor as a node leaving. The
hello is read as the beats are, on the link's one thread: a connection that says nothing is closed after
HELLO_TIMEOUT_S and holds up nothing meanwhile.

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

from pdserve.shared.cluster_auth import TOKEN_ENV, challenge, cluster_token, proof, proves
from pdserve.shared.tp_gate import Door, bind, read_line
from pdserve.shared.tp_group import RankGone
from pdserve.shared.tp_nodes import NodeClaimError

log = logging.getLogger(__name__)
BEAT_S = 0.5
HELLO_TIMEOUT_S = 2.0
CLOSE_WAIT_S = 1.0  # for the peer to read what this end said before it leaves
LINKED = "linked"
CLAIM_REFUSED = "claim refused: "
_HELLO_BYTES = 256  # the longest line of a hello


def answer(token: str | None, nonce: bytes, node: int) -> str:
    """A node's answer to rank 0's challenge: its number and the proof that it holds the token."""
    return f"{node} {proof(token, nonce + str(node).encode()).hex()}"


class _Hello:
    """A connection to rank 0's end that has not yet proved which node it is."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.sock, self.where = sock, where
        self.nonce = challenge()
        self.since = time.monotonic()
        self.partial = b""


class _Peer:
    def __init__(self, node: int, sock: socket.socket, where: str) -> None:
        self.node, self.sock, self.where = node, sock, where
        self.heard = time.monotonic()
        self.partial = b""


class Link:
    """One end of the liveness links: rank 0's (`listen`, every other node a peer) or a node's (`connect`, rank
    0's node its one peer). `poll` beats and listens; `lost` says which peer is gone and why, for good."""

    def __init__(self, timeout_s: float, nodes: range = range(0)) -> None:
        self.timeout_s = timeout_s
        self.nodes = nodes  # rank 0's end: the node numbers it grants
        self.peers: dict[int, _Peer] = {}
        self.lost: str | None = None
        self.listener: socket.socket | None = None
        self.door: Door | None = None
        self._listening = False
        self.token = cluster_token()
        self.hellos: list[_Hello] = []
        self._selector = selectors.DefaultSelector()
        self._last_beat = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------ the two ends
    @classmethod
    def listen(cls, timeout_s: float, host: str, nodes: range) -> Link:
        """Rank 0's end, on a free port of `host` (only), for the nodes numbered `nodes`; `start()` runs it on a
        thread of its own."""
        link = cls(timeout_s, nodes)
        link.listener = bind(host, 0, "the tensor-parallel liveness link")
        link.listener.setblocking(False)
        link.door = Door(link.listener, "tensor-parallel link")
        link._listen(True)
        return link

    def _listen(self, on: bool) -> None:
        if on != self._listening:
            self._listening = on
            if on:
                self._selector.register(self.listener, selectors.EVENT_READ)
            else:
                self._selector.unregister(self.listener)

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    @classmethod
    def connect(cls, host: str, port: int, node: int, timeout_s: float) -> Link:
        """A node's end: connected to rank 0's, which now knows this node (RankGone: it could not, or refused)."""
        link = cls(timeout_s)
        try:
            sock = socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S)
        except OSError as exc:
            raise RankGone(f"node {node}: cannot reach rank 0's node at {host}:{port}: {exc}") from None
        try:
            nonce = bytes.fromhex(read_line(sock))
            sock.sendall(f"{answer(link.token, nonce, node)}\n".encode())
            said = read_line(sock)
        except (OSError, ValueError) as exc:
            sock.close()
            raise RankGone(f"node {node}: no link with rank 0's node at {host}:{port}: {exc}") from None
        if said.startswith(CLAIM_REFUSED):
            sock.close()
            raise NodeClaimError(f"node {node}: rank 0's node at {host}:{port} refused its claim: "
                                 f"{said.removeprefix(CLAIM_REFUSED)}")
        if said != LINKED:
            sock.close()
            raise RankGone(f"node {node}: rank 0's node at {host}:{port} refused its link: {said}")
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
        if self.door is not None:
            self._listen(self.door.paused_s() == 0)  # (out of descriptors: not listening, not spinning)
        for key, _ in self._selector.select(wait_s):
            if key.fileobj is self.listener:
                self._accept()
            elif isinstance(key.data, _Hello):
                self._hear(key.data)
            else:
                self._read(key.data)
        now = time.monotonic()
        for hello in list(self.hellos):
            if now - hello.since > HELLO_TIMEOUT_S:
                self._refuse(hello, f"it did not say which node it is within {HELLO_TIMEOUT_S:g} s")
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
        _close_after_sent([peer.sock for peer in self.peers.values()])
        for conn in self.hellos:
            conn.sock.close()
        if self.listener is not None:
            self.listener.close()
        self._selector.close()

    def _accept(self) -> None:
        conn = self.door.accept()
        if conn is None:
            return
        sock, addr = conn
        hello = _Hello(sock, addr[0])
        sock.setblocking(False)
        try:
            sock.send(hello.nonce.hex().encode() + b"\n")  # (a new connection's buffer holds it)
        except OSError:
            sock.close()
            return
        self.hellos.append(hello)
        self._selector.register(sock, selectors.EVENT_READ, hello)

    def _hear(self, hello: _Hello) -> None:
        """A connecting node's answer: linked as a peer once it proves the token, else refused."""
        try:
            data = hello.sock.recv(_HELLO_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        hello.partial += data
        line, newline, _ = hello.partial.partition(b"\n")
        if not data or (not newline and len(hello.partial) >= _HELLO_BYTES):
            self._drop(hello)  # (nothing to answer: it left, or it does not speak this protocol)
            log.warning("tensor-parallel link: closed a connection from %s that did not say which node it is",
                        hello.where)
            return
        if not newline:
            return
        number, _, given = line.decode(errors="replace").partition(" ")
        try:
            node, proved = int(number), proves(self.token, hello.nonce + number.encode(), bytes.fromhex(given))
        except ValueError:
            node, proved = -1, False
        if not proved:
            self._refuse(hello, "its answer is not a node's hello" if self.token is None else
                         f"its answer does not prove this worker's cluster token ({TOKEN_ENV})")
        elif node not in self.nodes:
            self._refuse(hello, f"{CLAIM_REFUSED}node {node} is not a node of this worker: the others are numbered "
                                f"{self.nodes.start} to {self.nodes.stop - 1} (--nnodes {self.nodes.stop})")
        elif node in self.peers:
            self._refuse(hello, f"{CLAIM_REFUSED}node {node} is already linked from {self.peers[node].where}: two "
                                f"machines started with --node-rank {node}?")
        else:
            self._drop(hello, close=False)
            peer = _Peer(node, hello.sock, hello.where)
            self._add(peer)  # (before it hears it is linked: from then on it is)
            log.info("tensor-parallel node %d linked from %s", node, hello.where)
            try:
                peer.sock.send(f"{LINKED}\n".encode())
            except OSError as exc:
                self._lose(peer, f"its connection failed ({exc})")

    def _refuse(self, hello: _Hello, why: str) -> None:
        log.warning("tensor-parallel link: refused a connection from %s: %s", hello.where, why)
        try:
            hello.sock.send(why.encode() + b"\n")
        except OSError:
            pass
        self._drop(hello)

    def _drop(self, hello: _Hello, close: bool = True) -> None:
        self.hellos.remove(hello)
        self._selector.unregister(hello.sock)
        if close:
            hello.sock.close()

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


def _close_after_sent(socks: list[socket.socket], wait_s: float = CLOSE_WAIT_S) -> None:
    """Close so that what was said reaches the peers: a socket closed with beats still unread is reset, and a
    reset drops what this end sent but the network had not carried yet (the reason it leaves). So: no more
    sending, read until each peer closes its end (it does once it has read ours) or `wait_s` in all, then close."""
    end = time.monotonic() + wait_s
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    for sock in socks:
        try:
            sock.setblocking(True)
            while (left := end - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv(4096):
                    break
        except OSError:
            pass
        finally:
            sock.close()
