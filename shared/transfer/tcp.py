"""TCP transfer: the fallback where NIXL is not installed; plain sockets and threads.

Lifecycle: the constructor opens a listening socket (host from the `host` argument or
PDSERVE_TRANSFER_HOST, default 127.0.0.1; port 0 = ephemeral) and an accept thread;
each incoming connection gets a receiver thread that writes arriving pages straight
into the pool and acknowledges each message. The sending side keeps one persistent
connection per peer (reconnected lazily after a failure), used under a per-peer lock.

Each connection opens with a handshake in which the sender proves it holds the cluster token, then
carries messages (a run list and the pages' bytes), each acknowledged: tcp_wire.py. Anyone who can reach
the port can open a connection, so what a connection may cost before it proves anything is bounded: at
most MAX_UNPROVEN connections wait in their handshake at a time (more are closed at once) and each gets
HANDSHAKE_TIMEOUT seconds. The accept loop outlives any error (out of file descriptors or threads: it
waits and goes on); should it end anyway, `healthy()` turns false and the worker reports unhealthy.

An empty message (no runs) is the liveness check `add_peer` uses. A message is refused unless
every destination page is in an open window under the fence the message carries (`open_window`: pages
reserved for a request whose KV is on its way; fence.PageFences); `close_window` waits for a write into
those pages that already started.

CPU pools are sent from and received into a byte view of the pool itself (no copies);
CUDA pools are staged through a pinned host buffer, STAGING_BYTES at a time, unless the peer's pool is on a
GPU of the same host: then pages go by device copies into it (cuda_ipc.py) and the socket only checks that
the peer is alive when it is added.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.shared import cluster_auth
from pdserve.shared.transfer import cuda_ipc, tcp_wire
from pdserve.shared.transfer.base import KVTransfer, Run, TransferError
from pdserve.shared.transfer.fence import PageFences

RECV_TIMEOUT = 60.0  # a sender that stalls mid-message this long is dropped
HANDSHAKE_TIMEOUT = 5.0  # for a new connection to prove it holds the cluster token
MAX_UNPROVEN = 16  # connections in their handshake at once; a real cluster opens one per prefill worker
ACCEPT_RETRY_S = 0.1  # after an accept error (EMFILE, ENOBUFS, ...): a pause, not a spin

log = logging.getLogger(__name__)
STAGING_BYTES = 8 << 20  # CUDA pools: pinned host chunk per connection end


@dataclass
class _Peer:
    host: str
    port: int
    num_pages: int
    metadata: bytes
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    kv_heads: int = 1  # of the peer's pages
    staging: torch.Tensor | None = None  # CUDA pools only
    device_pool: torch.Tensor | None = None  # the peer's GPU pool as flat bytes, where CUDA IPC opened it


def _advertised(host: str) -> str:
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:  # listening on every interface: peers reach us by our host name's address
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TcpTransfer(KVTransfer):
    name = "tcp"

    def __init__(self, agent_name: str, pool: torch.Tensor, host: str | None = None, port: int = 0,
                 advertise_host: str | None = None, token: str | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        """`token`: the cluster token (default: from the environment; none: any sender is let in)."""
        super().__init__(agent_name, pool)
        self._handshake_timeout = handshake_timeout
        self._unproven = threading.BoundedSemaphore(MAX_UNPROVEN)
        self._token = token if token is not None else cluster_auth.cluster_token()
        self._fences = PageFences(self.num_pages)  # receiving side: which fence may write each page now
        self._bytes = pool.reshape(-1).view(torch.uint8)  # the pool's memory as flat bytes
        self._host_view = None if pool.is_cuda else memoryview(self._bytes.numpy())
        self._shared = cuda_ipc.share(pool)
        host = host or os.environ.get("PDSERVE_TRANSFER_HOST", "127.0.0.1")
        try:
            self._listener = socket.create_server((host, port))
        except OSError as exc:
            raise TransferError(f"cannot listen for KV transfers on {host}:{port}: {exc}") from None
        self.port = self._listener.getsockname()[1]
        self.host = advertise_host or os.environ.get("PDSERVE_TRANSFER_ADVERTISE_HOST") or _advertised(host)
        self._peers: dict[str, _Peer] = {}
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._accepter.start()

    def metadata(self) -> bytes:
        return self._pack(host=self.host, port=self.port, cuda_ipc=self._shared)

    # ------------------------------------------------------------ sending side
    def add_peer(self, peer_name: str, metadata: bytes, timeout: float = 10.0) -> None:
        md = self._unpack(peer_name, metadata)
        old = self._peers.get(peer_name)
        if old is not None and old.metadata == metadata:
            return
        if old is not None:
            self.remove_peer(peer_name)
        peer = _Peer(str(md["host"]), int(md["port"]), int(md["num_pages"]), metadata, kv_heads=md["kv_heads"])
        self._send(peer, [], timeout, f"connecting to {peer_name} at {peer.host}:{peer.port}")
        if self.pool.is_cuda:
            peer.device_pool = cuda_ipc.open_pool(md.get("cuda_ipc"), peer.num_pages * md["page_bytes"], peer_name)
        log.info("KV pages to %s go %s", peer_name,
                 "by device copies (CUDA IPC)" if peer.device_pool is not None else f"over TCP to {peer.host}")
        self._peers[peer_name] = peer

    def route(self, peer_name: str) -> str:
        """How pages reach the peer: "cuda_ipc" (device copies) or "socket"."""
        peer = self._peers.get(peer_name)
        return "cuda_ipc" if peer is not None and peer.device_pool is not None else "socket"

    def has_peer(self, peer_name: str) -> bool:
        return peer_name in self._peers

    def remove_peer(self, peer_name: str) -> None:
        peer = self._peers.pop(peer_name, None)
        if peer is not None:
            self._drop(peer)

    def write_pages(self, peer_name: str, src_pages: list[int], dst_pages: list[int],
                    timeout: float = 30.0, fence: int = 0) -> None:
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name} is not registered")
        if peer.kv_heads != self.kv_heads:
            raise TransferError(f"peer {peer_name} holds {peer.kv_heads} KV heads a page, this worker "
                                f"{self.kv_heads}: write_heads moves some of them")
        runs = self._runs(peer_name, peer.num_pages, src_pages, dst_pages)
        if runs and peer.device_pool is not None:  # one-sided: the fence was checked by the caller (fence.py)
            cuda_ipc.copy_pages(self.pool, peer.device_pool, runs)
        elif runs:
            self._send(peer, runs, timeout, f"writing {len(src_pages)} pages to {peer_name}", fence)

    def write_heads(self, peer_name: str, src_pages: list[int], dst_pages: list[int], src_heads: tuple[int, int],
                    dst_heads: tuple[int, int], timeout: float = 30.0, fence: int = 0) -> None:
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name} is not registered")
        if self._whole(peer.kv_heads, src_heads, dst_heads):
            return self.write_pages(peer_name, src_pages, dst_pages, timeout, fence)
        runs = self._runs(peer_name, peer.num_pages, src_pages, dst_pages)
        if not runs:
            return
        lo, hi = src_heads
        parts = [self.pool[r.src_start:r.src_start + r.length, :, :, :, lo:hi] for r in runs]
        if peer.device_pool is not None:  # the peer's pool on a GPU of this host: device copies into its heads
            return cuda_ipc.copy_heads(self.pool, peer.device_pool, peer.kv_heads, runs, parts, dst_heads)
        per_page = self.page_bytes // self.kv_heads * (hi - lo)
        self._send(peer, runs, timeout, f"writing heads {lo}..{hi - 1} of {len(src_pages)} pages to {peer_name}",
                   fence, heads=(dst_heads, parts, per_page))

    def _send(self, peer: _Peer, runs: list[Run], timeout: float, what: str, fence: int = 0, heads=None) -> None:
        """`heads`: (destination heads, each run's pages cut to the heads sent, bytes of one page's cut) for a
        message of some heads; None: whole pages."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            return remaining

        if not peer.lock.acquire(timeout=timeout):
            raise TransferError(f"{what}: the connection stayed busy for {timeout:g} s")
        try:
            if peer.sock is None:
                peer.sock = socket.create_connection((peer.host, peer.port), timeout=left())
                peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tcp_wire.prove(peer.sock, self._token, what)
            sock = peer.sock
            sock.settimeout(left())
            if heads is None:
                sock.sendall(tcp_wire.message_head(self.page_bytes, runs, fence))
                for r in runs:
                    for chunk in self._chunks(r.src_start, r.length, peer):
                        sock.settimeout(left())
                        sock.sendall(chunk)
            else:
                dst_heads, parts, per_page = heads
                sock.sendall(tcp_wire.message_head(per_page, runs, fence, dst_heads))
                for part in parts:
                    data = part.contiguous().cpu().reshape(-1).view(torch.uint8)
                    sock.settimeout(left())
                    sock.sendall(memoryview(data.numpy()))
            sock.settimeout(left())
            tcp_wire.expect_ack(sock, what)
        except TransferError:
            self._drop(peer)
            raise
        except TimeoutError:
            self._drop(peer)
            raise TransferError(f"{what}: no answer within {timeout:g} s") from None
        except OSError as exc:  # refused, reset, closed: the peer is gone or restarting
            self._drop(peer)
            raise TransferError(f"{what}: {exc}") from None
        finally:
            peer.lock.release()

    def _chunks(self, first: int, pages: int, peer: _Peer):
        """The bytes of pages [first, first + pages): one view of the pool, or staged host chunks."""
        a, b = first * self.page_bytes, (first + pages) * self.page_bytes
        if self._host_view is not None:
            yield self._host_view[a:b]
            return
        if peer.staging is None:
            peer.staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        for lo in range(a, b, STAGING_BYTES):
            n = min(STAGING_BYTES, b - lo)
            peer.staging[:n].copy_(self._bytes[lo:lo + n])
            yield memoryview(peer.staging.numpy())[:n]

    @staticmethod
    def _drop(peer: _Peer) -> None:
        if peer.sock is not None:
            peer.sock.close()
            peer.sock = None

    # ------------------------------------------------------------ receiving side
    def healthy(self) -> bool:
        return self._closed or self._accepter.is_alive()

    def _accept_loop(self) -> None:
        failing = False  # logged once per run of failures
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                if not failing:
                    log.warning("KV transfer: accepting connections fails (%s); retrying", exc)
                failing = True
                time.sleep(ACCEPT_RETRY_S)
                continue
            if failing:
                log.info("KV transfer: accepting connections again")
                failing = False
            try:
                self._start_receiver(conn)
            except Exception as exc:  # no thread or descriptor to spare: this connection only is dropped
                log.warning("KV transfer: dropped an incoming connection: %s", exc)
                self._conns.discard(conn)
                conn.close()

    def _start_receiver(self, conn: socket.socket) -> None:
        if self._closed or not self._unproven.acquire(blocking=False):
            conn.close()  # closing, or too many connections still owe their proof
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-recv", daemon=True).start()
        except BaseException:
            self._unproven.release()
            raise

    def _serve(self, conn: socket.socket) -> None:
        staging = None
        try:
            try:
                admitted = tcp_wire.admit(conn, self._token, self._handshake_timeout)
            finally:
                self._unproven.release()
            if not admitted:
                return
            while True:
                conn.settimeout(None)  # idle between messages is normal
                head = conn.recv(tcp_wire.HEADER.size, socket.MSG_WAITALL)
                if len(head) < tcp_wire.HEADER.size:
                    return  # the sender closed the connection
                conn.settimeout(RECV_TIMEOUT)
                magic, page_bytes, count, fence = tcp_wire.HEADER.unpack(head)
                if magic not in (tcp_wire.MAGIC, tcp_wire.HEADS_MAGIC) or count > self.num_pages:
                    return  # not our protocol: drop it
                heads = None
                if magic == tcp_wire.HEADS_MAGIC:
                    heads = tcp_wire.HEAD_RANGE.unpack(tcp_wire.recv_exact(conn, tcp_wire.HEAD_RANGE.size))
                runs = tcp_wire.read_runs(conn, count)
                error = self._check(page_bytes, runs, heads) or self._fences.claim(runs, fence)
                if error:
                    tcp_wire.refuse(conn, error)
                    return
                try:
                    if heads is not None:
                        for dst, pages in runs:
                            self._receive_heads(conn, dst, pages, heads)
                    else:
                        if self._host_view is None and staging is None:
                            staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
                        for dst, pages in runs:
                            self._receive(conn, dst, pages, staging)
                finally:
                    self._fences.unclaim(runs)
                tcp_wire.acknowledge(conn)
        except OSError:
            return  # sender died or stalled; it reports its own error
        finally:
            self._conns.discard(conn)
            conn.close()

    @property
    def checks_every_write(self) -> bool:  # unless a peer on this host may copy into our GPU pool (CUDA IPC)
        return self._shared is None

    # The windows: pages peers may write now, under which fence (see KVTransfer.open_window).
    def open_window(self, pages: list[int], fence: int = 0) -> None:
        self._fences.open(pages, fence)

    def close_window(self, pages: list[int]) -> None:
        # A message already being written into these pages: wait for its end (a stalled sender is dropped after
        # RECV_TIMEOUT), so that no byte of it lands once the pages belong to someone else.
        self._fences.close(pages, RECV_TIMEOUT + 1)

    def _check(self, page_bytes: int, runs: list[tuple[int, int]], heads: tuple[int, int] | None = None) -> str:
        if heads is not None:
            lo, hi = heads
            if not 0 <= lo < hi <= self.kv_heads or page_bytes != self.page_bytes // self.kv_heads * (hi - lo):
                return (f"KV heads {lo}..{hi - 1} of {page_bytes} bytes a page sent to a pool of {self.kv_heads} "
                        f"heads in pages of {self.page_bytes} bytes")
        elif page_bytes != self.page_bytes and runs:  # (an empty message only checks that the receiver is alive)
            return f"pages of {page_bytes} bytes sent to a pool with pages of {self.page_bytes} bytes"
        for dst, pages in runs:
            if dst + pages > self.num_pages:
                return f"destination pages {dst}..{dst + pages - 1} outside the pool ({self.num_pages} pages)"
        return ""

    def _receive(self, conn: socket.socket, dst: int, pages: int, staging: torch.Tensor | None) -> None:
        a, b = dst * self.page_bytes, (dst + pages) * self.page_bytes
        if staging is None:
            tcp_wire.recv_into(conn, self._host_view[a:b])
            return
        for lo in range(a, b, STAGING_BYTES):
            n = min(STAGING_BYTES, b - lo)
            tcp_wire.recv_into(conn, memoryview(staging.numpy())[:n])
            self._bytes[lo:lo + n].copy_(staging[:n])

    def _receive_heads(self, conn: socket.socket, dst: int, pages: int, heads: tuple[int, int]) -> None:
        """Some heads of each page: received whole, then copied into those heads of the pool's pages."""
        lo, hi = heads
        part = torch.empty((pages, *self.pool.shape[1:4], hi - lo, self.pool.shape[5]), dtype=self.pool.dtype)
        tcp_wire.recv_into(conn, memoryview(part.reshape(-1).view(torch.uint8).numpy()))
        self.pool[dst:dst + pages, :, :, :, lo:hi].copy_(part)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        except OSError:
            pass
        self._listener.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for name in list(self._peers):
            self.remove_peer(name)
        self._accepter.join(timeout=2)
