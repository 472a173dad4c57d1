"""The rendezvous of a tensor-parallel worker over several machines, behind the cluster token.

torch.distributed's TCPStore authenticates nobody, and any client of it may list every key (`list_keys`), then
read, overwrite or delete them: the posts carry the prompts' tokens, and gloo finds its peers' addresses there. A
namespace of keys derived from the token would not hold (the first `list_keys` shows it), and tags on the values
would leave them readable and deletable. So the store never faces the network: rank 0 serves it on loopback
(`loopback_store`, on a socket bound before the store takes it: no free-port race), and the rendezvous port
(--dist-init-addr, bound to that address only) is a `Gate`. A connection there gets a random challenge and must
answer HMAC-SHA256(token, challenge + "store") within HELLO_TIMEOUT_S; only then does the gate open a connection
to the store and relay bytes both ways. On every other node a `Tunnel` listens on loopback and carries that node's
store connections through the gate, answering the challenge for them. A process without the token reaches no key,
not even how many there are; the token never crosses the wire. (Without a token any answer does, as on the
workers' other ports.)

Loopback ports are as private as the machine's network namespace (a pod's is its own). The relay carries a few
small messages per step, on threads of its own, with Nagle's algorithm off. An accept that fails for want of file
descriptors (EMFILE) does not end a door's thread (`Door`): it is logged, and the door waits a little before it
tries again, so it opens again once descriptors are free.
"""
from __future__ import annotations

import datetime
import errno
import logging
import socket
import threading
import time

from pdserve.shared.cluster_auth import TOKEN_ENV, challenge, cluster_token, proof, proves

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 2.0
MAX_HELLOS = 32  # connections at once that have not proved the token yet; more are closed at once
OPEN = "open"
REFUSED = "refused: "
_PURPOSE = b"store"
_LINE_BYTES = 256
_PAUSE_S = (0.05, 1.0)  # a door's first and longest wait after running out of descriptors
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_WAIT_S = 0.5  # a door's thread looks at whether it was closed this often


class Door:
    """A listening socket whose accept survives a process out of descriptors (and a connection gone before it
    was accepted): `accept` returns None then, and `paused_s` says how long to wait before the next try."""

    def __init__(self, listener: socket.socket, what: str) -> None:
        self.listener, self.what = listener, what
        self.refused = 0  # accepts that failed for want of descriptors
        self._until = 0.0
        self._pause = _PAUSE_S[0]

    def paused_s(self) -> float:
        return max(0.0, self._until - time.monotonic())

    def accept(self) -> tuple[socket.socket, tuple] | None:
        if self.paused_s() > 0:
            return None
        try:
            conn = self.listener.accept()
        except (BlockingIOError, TimeoutError, InterruptedError, ConnectionAbortedError):
            return None
        except OSError as exc:
            if exc.errno not in _OUT_OF_FDS:
                raise
            self.refused += 1
            log.warning("%s: cannot accept a connection (%s); trying again in %.2f s", self.what, exc.strerror,
                        self._pause)
            self._until = time.monotonic() + self._pause
            self._pause = min(self._pause * 2, _PAUSE_S[1])
            return None
        self._pause = _PAUSE_S[0]
        return conn


def bind(host: str, port: int, what: str, resolve_s: float = 30.0) -> socket.socket:
    """A listening socket on `host` only (never every interface); a ValueError says why it cannot be. A name that
    does not resolve yet is tried again for `resolve_s` (a pod's own DNS name is published shortly after it
    starts)."""
    deadline = time.monotonic() + resolve_s
    while True:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            listener = socket.create_server((host, port))
            break
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise ValueError(f"cannot listen for {what} on {host}:{port}: the name does not resolve ({exc})") \
                    from None
            time.sleep(1.0)
        except OSError as exc:
            raise ValueError(f"cannot listen for {what} on {host}:{port} (it must be an address of this machine, "
                             f"and the port free): {exc}") from None
    listener.settimeout(_WAIT_S)
    return listener


def loopback_store(timeout_s: float):
    """Rank 0's TCPStore, on a loopback port it holds from the start."""
    import torch.distributed as dist

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    try:
        return dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=sock.fileno())
    finally:
        sock.detach()  # (the store's now: it closes it)


class _Doorway:
    """A door served on a thread of its own, each connection on a thread of its own (a subclass sets what
    `carry` needs before it calls this `__init__`, which opens the door)."""

    def __init__(self, listener: socket.socket, what: str) -> None:
        self.door = Door(listener, what)
        self._closed = False
        self._hellos = threading.BoundedSemaphore(MAX_HELLOS)
        threading.Thread(target=self._serve, name="tp-door", daemon=True).start()

    @property
    def port(self) -> int:
        return self.door.listener.getsockname()[1]

    def close(self) -> None:
        self._closed = True
        self.door.listener.close()

    def _serve(self) -> None:
        while not self._closed:
            time.sleep(self.door.paused_s())
            try:
                conn = self.door.accept()
            except OSError:
                if self._closed:
                    return
                raise
            if conn is None:
                continue
            if not self._hellos.acquire(blocking=False):
                log.warning("%s: closed a connection from %s: %d others have not said who they are yet",
                            self.door.what, conn[1][0], MAX_HELLOS)
                conn[0].close()
                continue
            threading.Thread(target=self._serve_one, args=conn, name="tp-door-conn", daemon=True).start()

    def _serve_one(self, sock: socket.socket, addr: tuple) -> None:
        hello_done = [False]

        def done() -> None:
            if not hello_done[0]:
                hello_done[0] = True
                self._hellos.release()
        try:
            self.carry(sock, addr[0], done)
        finally:
            done()

    def carry(self, sock: socket.socket, where: str, hello_done) -> None:
        raise NotImplementedError


class Gate(_Doorway):
    """Rank 0's rendezvous port: a connection that proves the token reaches the store on `store_port`."""

    def __init__(self, host: str, port: int, store_port: int) -> None:
        self.store_port = store_port
        self.token = cluster_token()
        super().__init__(bind(host, port, "the ranks' rendezvous (--dist-init-addr)"), "tensor-parallel rendezvous")

    def carry(self, sock: socket.socket, where: str, hello_done) -> None:
        nonce = challenge()
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            sock.sendall(nonce.hex().encode() + b"\n")
            given = bytes.fromhex(read_line(sock))
        except (OSError, ValueError):
            given = None
        hello_done()
        if given is None or not proves(self.token, nonce + _PURPOSE, given):
            why = "it did not answer the challenge" if given is None else \
                f"its answer does not prove this worker's cluster token ({TOKEN_ENV})"
            log.warning("tensor-parallel rendezvous: refused a connection from %s: %s", where, why)
            _say_and_close(sock, REFUSED + why)
            return
        try:
            store = socket.create_connection(("127.0.0.1", self.store_port), timeout=HELLO_TIMEOUT_S)
            sock.sendall(f"{OPEN}\n".encode())
        except OSError as exc:
            _say_and_close(sock, f"rank 0's store is not there: {exc}")
            return
        relay(sock, store)


class Tunnel(_Doorway):
    """A node's loopback way to rank 0's store: each connection goes through the gate at host:port.
    `refused`: why the gate refused the last one (another token?), for the node's error."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.gate_port = host, port
        self.token = cluster_token()
        self.refused: str | None = None
        super().__init__(bind("127.0.0.1", 0, "this node's way to rank 0's store"), "tensor-parallel tunnel")

    def reach(self, timeout_s: float) -> str | None:
        """Wait until the gate lets this node in (None), or why not: refused, or not up within `timeout_s`. (So
        that the store's clients connect once rank 0 is there, rather than fail loudly until it is.)"""
        deadline = time.monotonic() + timeout_s
        while True:
            remote = self._through()
            if remote is not None:
                remote.close()
                return None
            if self.refused is not None:
                return self.refused
            if time.monotonic() > deadline:
                return f"no tensor-parallel rank 0 at {self.host}:{self.gate_port} within {timeout_s:g} s"
            time.sleep(0.2)

    def carry(self, sock: socket.socket, where: str, hello_done) -> None:
        remote = self._through()
        hello_done()
        if remote is None:  # (rank 0 not up yet: the store's client tries again)
            sock.close()
            return
        relay(sock, remote)

    def _through(self) -> socket.socket | None:
        """A connection through the gate (None: refused, noted in `refused`, or rank 0 not there)."""
        try:
            remote = socket.create_connection((self.host, self.gate_port), timeout=HELLO_TIMEOUT_S)
        except OSError:
            return None
        try:
            nonce = bytes.fromhex(read_line(remote))
            remote.sendall(proof(self.token, nonce + _PURPOSE).hex().encode() + b"\n")
            said = read_line(remote)
        except (OSError, ValueError) as exc:
            said = f"no answer from rank 0's rendezvous: {exc}"
        if said == OPEN:
            return remote
        if said.startswith(REFUSED):
            self.refused = f"rank 0's rendezvous at {self.host}:{self.gate_port} refused this node: " \
                           f"{said.removeprefix(REFUSED)}"
            log.error("%s", self.refused)
        remote.close()
        return None


def relay(a: socket.socket, b: socket.socket) -> None:
    """Bytes both ways until either side closes; then both are closed."""
    for s in (a, b):
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(b, a), name="tp-relay", daemon=True)
    back.start()
    _pump(a, b)
    back.join()
    a.close()
    b.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    try:  # the other way ends too
        src.shutdown(socket.SHUT_RDWR)
        dst.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def read_line(sock: socket.socket) -> str:
    """One line of a hello, a byte at a time so nothing after it is taken (it is the store's)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError("the connection closed")
        if len(line) >= _LINE_BYTES:
            raise ValueError("not a tensor-parallel rendezvous hello")
        line += byte
    return line[:-1].decode(errors="replace")


def _say_and_close(sock: socket.socket, why: str) -> None:
    try:
        sock.sendall(why.encode() + b"\n")
    except OSError:
        pass
    sock.close()
