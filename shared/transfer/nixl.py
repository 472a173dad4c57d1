"""NIXL (UCX) transfer: one-sided RDMA-style WRITEs straight into the peer's registered pool.

Lifecycle: one NIXL agent per worker, UCX backend, progress thread off (it busy-polls a
core). The pool is registered once (DRAM or VRAM). `add_peer` loads the peer's agent
metadata and warms the connection with a tiny READ into a private scratch buffer, so
the peer's pool is never touched by set-up. With the progress thread off, connection
set-up completes only while the *target* keeps calling `poll()`; once a connection is
up, WRITEs complete without the target's help.

Invariant: every NIXL call goes through `self._lock` (the agent is created without
internal locking) and is never held while waiting, so `poll()` and other transfers
interleave; every transfer handle is released on every path.

Fences (fence.py): a WRITE lands without the receiver's involvement, so the fence a write
carries is checked by the sender before it is posted, never here; what this module owns is
that a WRITE ends within its timeout: one that did not complete in time (or whose handle
could not be released) tears down the connection to that peer, after which UCX moves none
of its bytes. The peer's next registration connects again.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
from nixl._api import nixl_agent, nixl_agent_config

from pdserve.shared.transfer.base import KVTransfer, TransferError, b64, merge_runs, unb64

log = logging.getLogger(__name__)

WARMUP_BYTES = 64
STAGING_BYTES = 16 << 20  # heads of pages packed for a peer that holds only those heads, a chunk at a time
SPIN_S = 0.001  # poll a posted transfer without sleeping this long (GPU copies finish in ~0.1 ms)


@dataclass(frozen=True)
class _Peer:
    nixl_name: str | bytes  # the name NIXL knows the peer by (from its agent metadata)
    metadata: bytes
    base: int
    num_pages: int
    mem: str  # "DRAM" | "VRAM"
    device: int
    kv_heads: int = 1  # of the peer's pages


class NixlTransfer(KVTransfer):
    name = "nixl"

    def __init__(self, agent_name: str, pool: torch.Tensor) -> None:
        super().__init__(agent_name, pool)
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self._agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL started without its UCX backend (check UCX_TLS and the nixl install)")
        self._mem = "VRAM" if pool.is_cuda else "DRAM"
        self._device = pool.get_device() if pool.is_cuda else 0
        self._scratch = torch.zeros(WARMUP_BYTES, dtype=torch.uint8, device=pool.device)
        self._staging: torch.Tensor | None = None  # registered on first use (tensor-parallel peers only)
        self._staging_reg = None
        self._staging_lock = threading.Lock()
        try:
            self._reg = self._agent.register_memory([pool, self._scratch])
        except Exception as exc:
            raise TransferError(f"NIXL cannot register the KV pool ({self.num_pages} pages): {exc}") from None

    def metadata(self) -> bytes:
        with self._lock:
            agent_md = self._agent.get_agent_metadata()
        return self._pack(agent=b64(agent_md), base=self.pool.data_ptr(), mem=self._mem, device=self._device)

    def add_peer(self, peer_name: str, metadata: bytes, timeout: float = 10.0) -> None:
        md = self._unpack(peer_name, metadata)
        old = self._peers.get(peer_name)
        if old is not None and old.metadata == metadata:
            return
        if old is not None:  # the peer restarted: its old address is dead
            self.remove_peer(peer_name)
        try:
            with self._lock:
                nixl_name = self._agent.add_remote_agent(unb64(md["agent"]))
                self._agent.make_connection(nixl_name)
        except Exception as exc:
            raise TransferError(f"peer {peer_name}: NIXL rejected its metadata: {exc}") from None
        peer = _Peer(nixl_name, metadata, int(md["base"]), int(md["num_pages"]), md["mem"], int(md["device"]),
                     md["kv_heads"])
        warm = min(WARMUP_BYTES, self.page_bytes)
        try:  # the first transfer pays for connection set-up: do it now, harmlessly
            self._xfer("READ", [(self._scratch.data_ptr(), warm, self._device)],
                       [(peer.base, warm, peer.device)], peer, timeout, f"connecting to {peer_name}")
        except TransferError:
            self._forget(peer)
            raise
        self._peers[peer_name] = peer

    def has_peer(self, peer_name: str) -> bool:
        return peer_name in self._peers

    def remove_peer(self, peer_name: str) -> None:
        peer = self._peers.pop(peer_name, None)
        if peer is not None:
            self._forget(peer)

    def _forget(self, peer: _Peer) -> None:
        try:
            with self._lock:
                self._agent.remove_remote_agent(peer.nixl_name)
        except Exception as exc:  # already disconnected: nothing left to drop
            log.debug("removing NIXL agent %s: %s", peer.nixl_name, exc)

    def write_pages(self, peer_name: str, src_pages: list[int], dst_pages: list[int],
                    timeout: float = 30.0, fence: int = 0) -> None:
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name} is not registered")
        if peer.kv_heads != self.kv_heads:
            raise TransferError(f"peer {peer_name} holds {peer.kv_heads} KV heads a page, this worker "
                                f"{self.kv_heads}: write_heads moves some of them")
        runs = self._runs(peer_name, peer.num_pages, src_pages, dst_pages)
        if not runs:
            return
        base, pb = self.pool.data_ptr(), self.page_bytes
        local = [(base + r.src_start * pb, r.length * pb, self._device) for r in runs]
        remote = [(peer.base + r.dst_start * pb, r.length * pb, peer.device) for r in runs]
        self._xfer("WRITE", local, remote, peer, timeout, f"writing {len(src_pages)} pages to {peer_name}")

    def write_heads(self, peer_name: str, src_pages: list[int], dst_pages: list[int], src_heads: tuple[int, int],
                    dst_heads: tuple[int, int], timeout: float = 30.0, fence: int = 0) -> None:
        """Into a peer holding just the heads sent (a narrower decode rank), packed here into whole pages of its
        layout and written a run of pages per descriptor (`_write_packed`). Otherwise some heads of each page are
        one strided run per layer, K/V and token of the page: a descriptor each (layers * 2 * page_size per page),
        read and written in place on both sides (about 20x slower for the same bytes)."""
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferError(f"peer {peer_name} is not registered")
        if self._whole(peer.kv_heads, src_heads, dst_heads):
            return self.write_pages(peer_name, src_pages, dst_pages, timeout)
        self._runs(peer_name, peer.num_pages, src_pages, dst_pages)  # the page checks
        if not src_pages:
            return
        page_bytes = self.page_bytes // self.kv_heads * (src_heads[1] - src_heads[0])
        if dst_heads == (0, peer.kv_heads) and page_bytes <= STAGING_BYTES:
            return self._write_packed(peer, peer_name, src_pages, dst_pages, src_heads, page_bytes, timeout)
        head_bytes = self.page_bytes // self.kv_heads // (self.pool.shape[1] * 2 * self.pool.shape[3])
        rows = torch.arange(self.pool.shape[1] * 2 * self.pool.shape[3], dtype=torch.int64)  # token rows of a page
        size = (src_heads[1] - src_heads[0]) * head_bytes

        def addresses(base: int, pages: list[int], heads: int, first: int) -> list[int]:
            page_bytes = rows.numel() * heads * head_bytes
            at = torch.tensor(pages, dtype=torch.int64)[:, None] * page_bytes + rows[None, :] * heads * head_bytes
            return (at.reshape(-1) + base + first * head_bytes).tolist()

        local = [(a, size, self._device) for a in addresses(self.pool.data_ptr(), src_pages, self.kv_heads,
                                                             src_heads[0])]
        remote = [(a, size, peer.device) for a in addresses(peer.base, dst_pages, peer.kv_heads, dst_heads[0])]
        self._xfer("WRITE", local, remote, peer, timeout,
                   f"writing heads {src_heads[0]}..{src_heads[1] - 1} of {len(src_pages)} pages to {peer_name}")

    def _write_packed(self, peer: _Peer, peer_name: str, src_pages: list[int], dst_pages: list[int],
                      src_heads: tuple[int, int], page_bytes: int, timeout: float) -> None:
        h0, h1 = src_heads
        with self._staging_lock:
            if self._staging is None:
                staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=self.pool.device)
                try:
                    with self._lock:
                        self._staging_reg = self._agent.register_memory([staging])
                except Exception as exc:
                    raise TransferError(f"NIXL cannot register a staging buffer: {exc}") from None
                self._staging = staging
            per_chunk = STAGING_BYTES // page_bytes
            shape = (*self.pool.shape[1:4], h1 - h0, self.pool.shape[5])
            base = self._staging.data_ptr()
            for lo in range(0, len(src_pages), per_chunk):
                chunk = src_pages[lo:lo + per_chunk]
                packed = self._staging[:len(chunk) * page_bytes].view(self.pool.dtype).view(len(chunk), *shape)
                for j, page in enumerate(chunk):
                    packed[j].copy_(self.pool[page, :, :, :, h0:h1])
                runs = merge_runs(list(range(len(chunk))), dst_pages[lo:lo + per_chunk])
                local = [(base + r.src_start * page_bytes, r.length * page_bytes, self._device) for r in runs]
                remote = [(peer.base + r.dst_start * page_bytes, r.length * page_bytes, peer.device) for r in runs]
                self._xfer("WRITE", local, remote, peer, timeout,
                           f"writing heads {h0}..{h1 - 1} of {len(chunk)} pages to {peer_name}")

    def _xfer(self, op: str, local: list[tuple], remote: list[tuple], peer: _Peer, timeout: float,
              what: str) -> None:
        """Post one transfer and wait for it, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        handle, state = None, "PROC"
        try:
            with self._lock:
                local_descs = self._agent.get_xfer_descs(local, self._mem)
                remote_descs = self._agent.get_xfer_descs(remote, peer.mem)
                handle = self._agent.initialize_xfer(op, local_descs, remote_descs, peer.nixl_name)
                state = self._agent.transfer(handle)
            spin_until = time.monotonic() + SPIN_S
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(f"{what}: no completion after {timeout:g} s (peer stalled or gone)")
                if now > spin_until:  # a long transfer: stop burning a core the peer may need
                    time.sleep(0.0002)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{what}: NIXL reported an error (peer gone?)")
        except TransferError:
            raise
        except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError when the peer died
            raise TransferError(f"{what}: {type(exc).__name__}: {exc}") from None
        finally:
            if handle is not None:
                try:
                    with self._lock:
                        handle.release()
                except Exception as exc:  # aborting an unfinished transfer may complain; the agent keeps it
                    log.debug("releasing NIXL transfer handle: %s", exc)
                    state = "PROC"
            if op == "WRITE" and handle is not None and state == "PROC":  # unfinished: no byte may land later
                self._tear_down(peer, what)

    def _tear_down(self, peer: _Peer, what: str) -> None:
        log.warning("%s did not finish: the connection to that peer is torn down (it connects again when it "
                    "registers)", what)
        for name, known in list(self._peers.items()):
            if known is peer:
                self.remove_peer(name)
                return
        self._forget(peer)

    def poll(self) -> None:
        # progress UCX (connection set-up from initiators); skip if a transfer is progressing it already
        if self._lock.acquire(blocking=False):
            try:
                self._agent.get_new_notifs()
            finally:
                self._lock.release()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            with self._lock:
                self._agent.deregister_memory(self._reg)
                if self._staging_reg is not None:
                    self._agent.deregister_memory(self._staging_reg)
        except Exception as exc:
            log.debug("deregistering the KV pool: %s", exc)
