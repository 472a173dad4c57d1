"""KV transfer: one-sided writes of KV pages from this worker's pool into a peer's pool.

Lifecycle: create one transfer per worker over its whole KV pool (registered once),
hand `metadata()` to peers out of band, `add_peer()` each peer that this worker writes
to (connects and warms the connection), then `write_pages()` as often as needed. The
target side only calls `poll()` periodically; it learns that data arrived from the
initiator (over gRPC, after `write_pages` returned), so the data path carries no
notifications. `close()` releases everything.

Every write carries the fence of the reservation it fills (fence.py): the receiving side opens its pages under
that fence, and pages go to another request only once no write of it can land.

Invariant: the pool is one contiguous, page-major tensor `[num_pages, ...]`, so page i
occupies bytes `[base + i * page_bytes, base + (i + 1) * page_bytes)` and a run of
consecutive pages is one byte range. Two pools can exchange whole pages only if their
`page_bytes` are equal; every call that could hang takes a timeout.

Tensor-parallel workers hold some of a page's KV heads per rank (a KVPool's
`[num_pages, layers, 2, page_size, kv_heads, head_dim]`): `write_heads` moves a range of a
page's heads into a range of the peer's, where the two pools' bytes per head agree.
"""
from __future__ import annotations

import base64
import importlib
import json
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from pdserve.shared.transfer.errors import TransferError


class Run(NamedTuple):
    src_start: int
    dst_start: int
    length: int


def merge_runs(src_pages: list[int], dst_pages: list[int]) -> list[Run]:
    """Group (src, dst) page pairs into runs that are consecutive on both sides, in order."""
    n = len(src_pages)
    if n != len(dst_pages):
        raise ValueError(f"{n} source pages but {len(dst_pages)} destination pages")
    runs: list[Run] = []
    start = 0
    for i in range(1, n + 1):  # close the current run at the end or where either side jumps
        if i == n or src_pages[i] != src_pages[i - 1] + 1 or dst_pages[i] != dst_pages[i - 1] + 1:
            runs.append(Run(int(src_pages[start]), int(dst_pages[start]), i - start))
            start = i
    return runs


class KVTransfer(ABC):
    """Moves pages of `pool` into pages of registered peers' pools."""

    name: str

    def __init__(self, agent_name: str, pool: torch.Tensor) -> None:
        if pool.dim() < 1 or pool.shape[0] == 0 or not pool.is_contiguous():
            raise ValueError("the KV pool must be a contiguous tensor [num_pages, ...] with at least one page")
        self.agent_name = agent_name
        self.pool = pool
        self.num_pages = pool.shape[0]
        self.page_bytes = pool[0].numel() * pool.element_size()
        # A KV pool's heads (dim 4 of [pages, layers, 2, page_size, heads, head_dim]); a bare buffer: one "head".
        self.kv_heads = pool.shape[4] if pool.dim() == 6 else 1

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this pool (address, layout), as opaque bytes."""

    @abstractmethod
    def add_peer(self, peer_name: str, metadata: bytes, timeout: float = 10.0) -> None:
        """Connect to a peer once and warm the connection; idempotent.

        Re-adding a name with different metadata (the peer restarted) replaces it.
        Raises TransferError when the peer is unreachable within `timeout` or its
        pool layout does not match ours.
        """

    @abstractmethod
    def has_peer(self, peer_name: str) -> bool:
        """Whether `add_peer` succeeded for this name (and it was not removed since)."""

    @abstractmethod
    def remove_peer(self, peer_name: str) -> None:
        """Forget a peer and drop its connection; unknown names are ignored."""

    @abstractmethod
    def write_pages(self, peer_name: str, src_pages: list[int], dst_pages: list[int],
                    timeout: float = 30.0, fence: int = 0) -> None:
        """Copy local pages `src_pages[i]` into the peer's pages `dst_pages[i]`, under the reservation's `fence`.

        Returns once the bytes are in the peer's memory. Raises TransferError on a
        bad page id, an unknown or dead peer, a refusal (the pages' fence is another),
        or when `timeout` passes; never hangs. A write that timed out tears the
        connection to the peer down, so that no byte of it lands later.
        """

    def write_heads(self, peer_name: str, src_pages: list[int], dst_pages: list[int], src_heads: tuple[int, int],
                    dst_heads: tuple[int, int], timeout: float = 30.0, fence: int = 0) -> None:
        """Copy the KV heads [src_heads) of local pages `src_pages[i]` into heads [dst_heads) of the peer's
        pages `dst_pages[i]` (as many heads on both sides; every other head of the peer's pages untouched).
        Whole pages on both sides are `write_pages`. Raises TransferError as write_pages does."""
        raise TransferError(f"the {self.name} transfer cannot write part of a page's KV heads")

    def _whole(self, peer_heads: int, src_heads: tuple[int, int], dst_heads: tuple[int, int]) -> bool:
        if src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]:
            raise TransferError(f"heads {src_heads[0]}..{src_heads[1] - 1} cannot fill peer heads "
                                f"{dst_heads[0]}..{dst_heads[1] - 1}: not as many")
        if not (0 <= src_heads[0] < src_heads[1] <= self.kv_heads and 0 <= dst_heads[0] < dst_heads[1] <= peer_heads):
            raise TransferError(f"heads {src_heads} -> {dst_heads} outside the pools' {self.kv_heads} and "
                                f"{peer_heads} heads")
        return src_heads == (0, self.kv_heads) and dst_heads == (0, peer_heads)

    def poll(self) -> None:
        """Target-side progress; the owner calls it periodically (cheap when idle)."""

    def healthy(self) -> bool:
        """Whether peers can still write into this pool; a worker whose transfer is not reports unhealthy."""
        return True

    # Receiving side: the pages a peer may write now, and under which fence. A decode worker opens a window over
    # a request's reserved pages before it asks for them to be filled, and closes it when that call ended. Where
    # the receiver sees each write (TCP's socket) it refuses one into a closed page or under another fence;
    # one-sided writes (NIXL, CUDA IPC) it never sees: their senders check the fence (fence.py), and the
    # receiver keeps the pages until the fence is settled.
    # Whether every write into this pool passes the receiver's check (TCP's socket), so that closing a window is
    # enough to keep late writes out; one-sided routes (NIXL, CUDA IPC) need the fence settled with the sender.
    checks_every_write = False

    def open_window(self, pages: list[int], fence: int = 0) -> None:
        """Let writes that carry `fence` into `pages` until `close_window`."""

    def close_window(self, pages: list[int]) -> None:
        """No write into `pages` lands from now on through this receiver (one in progress finishes first)."""

    @abstractmethod
    def close(self) -> None:
        """Drop every connection and release the pool registration; idempotent."""

    # ------------------------------------------------------------ helpers for backends
    def _pack(self, **fields) -> bytes:
        return json.dumps({"backend": self.name, "page_bytes": self.page_bytes,
                           "num_pages": self.num_pages, "kv_heads": self.kv_heads, **fields}).encode()

    def _unpack(self, peer_name: str, metadata: bytes) -> dict:
        """Decode a peer's metadata and check that its pool can take our pages (or, with as many bytes per KV
        head, some of their heads)."""
        try:
            md = json.loads(metadata)
            backend, page_bytes = md["backend"], int(md["page_bytes"])
            md["num_pages"] = int(md["num_pages"])
            md["kv_heads"] = int(md.get("kv_heads", 1))
        except (ValueError, TypeError, KeyError) as exc:
            raise TransferError(f"peer {peer_name}: unreadable transfer metadata ({exc})") from None
        if backend != self.name:
            raise TransferError(f"peer {peer_name} uses transfer backend {backend!r}, this worker uses {self.name!r}")
        if page_bytes * self.kv_heads != self.page_bytes * md["kv_heads"]:
            raise TransferError(f"peer {peer_name} has KV pages of {page_bytes} bytes for {md['kv_heads']} heads, "
                                f"this worker {self.page_bytes} bytes for {self.kv_heads}: page size, layers, "
                                "head_dim and dtype must all match")
        return md

    def _runs(self, peer_name: str, peer_num_pages: int, src_pages: list[int], dst_pages: list[int]) -> list[Run]:
        try:
            runs = merge_runs(src_pages, dst_pages)
        except ValueError as exc:
            raise TransferError(str(exc)) from None
        for r in runs:
            if r.src_start < 0 or r.src_start + r.length > self.num_pages:
                raise TransferError(f"source pages {r.src_start}..{r.src_start + r.length - 1} "
                                    f"outside this pool of {self.num_pages} pages")
            if r.dst_start < 0 or r.dst_start + r.length > peer_num_pages:
                raise TransferError(f"destination pages {r.dst_start}..{r.dst_start + r.length - 1} "
                                    f"outside the pool of {peer_name} ({peer_num_pages} pages)")
        return runs


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


# name -> (module, class, install hint); modules are imported only when chosen
_BACKENDS = {
    "nixl": ("pdserve.shared.transfer.nixl", "NixlTransfer",
             "install NIXL with `pip install nixl-cu12 && pip install --no-deps nixl` "
             "(or `pip install pdserve[nixl]`), or choose --transfer-backend tcp"),
    "tcp": ("pdserve.shared.transfer.tcp", "TcpTransfer", ""),
}
_importable: dict[str, bool] = {}


def _load(backend: str) -> type[KVTransfer]:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose one of {sorted(_BACKENDS)}")
    module, cls, hint = _BACKENDS[backend]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise ImportError(f"transfer backend {backend!r} is not available ({exc}): {hint}") from exc


def available_backends() -> list[str]:
    """Backends that import here, preferred first (nixl, then tcp)."""
    for backend in _BACKENDS:
        if backend not in _importable:
            try:
                _load(backend)
                _importable[backend] = True
            except ImportError:
                _importable[backend] = False
    return [b for b in _BACKENDS if _importable[b]]


def create_transfer(backend: str, agent_name: str, pool: torch.Tensor, **kwargs) -> KVTransfer:
    """The transfer `backend` ("nixl", "tcp" or "auto": the first available) over `pool`."""
    if backend == "auto":
        backend = available_backends()[0]
    return _load(backend)(agent_name, pool, **kwargs)
