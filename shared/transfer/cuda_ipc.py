"""CUDA IPC: KV pages written from one GPU pool into another on the same host by device copies.

A pool on a GPU shares its memory through a CUDA IPC handle (the one torch.multiprocessing passes for CUDA
tensors), sent with the host's boot id in the transfer metadata. A sender on the same host opens it once
(`open_pool`) and then writes a run of pages with one device-to-device copy: no staging through pinned host
memory, no socket. Such writes are one-sided, as NIXL's are: the receiver cannot refuse one, so the fence of the
reservation they fill is checked by the sender before each copy (fence.SenderFences, around the whole write), and
a copy is bounded by construction: it is synchronised before the write returns, so no byte of it lands after the
sender's fence released it (the receiving side's windows also guard the socket path). Where the
handle cannot be opened (another host, a container outside the peer's IPC namespace, a driver refusal), the
sender keeps the socket.

The metadata holds integers and base64 text only: nothing a peer sends is unpickled.
"""
from __future__ import annotations

import logging

import torch

from pdserve.shared.transfer.base import Run, b64, unb64

log = logging.getLogger(__name__)


def boot_id() -> str:
    """This host's identity for IPC: handles open only where the exporting process runs (same kernel boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def share(pool: torch.Tensor) -> dict | None:
    """What a peer on this host needs to open `pool` (None: the pool is not on a GPU, or IPC is unavailable)."""
    if not pool.is_cuda or not boot_id():
        return None
    try:
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = \
            pool.untyped_storage()._share_cuda_()
    except RuntimeError as exc:  # e.g. memory from an allocator without IPC support
        log.info("KV pool memory cannot be shared by CUDA IPC (%s): peers write through the socket", exc)
        return None
    return {"boot_id": boot_id(), "device": device, "handle": b64(handle), "size": size, "offset": offset,
            "ref_handle": b64(ref_handle), "ref_offset": ref_offset, "event_handle": b64(event_handle or b""),
            "event_sync": bool(event_sync), "byte_offset": pool.storage_offset() * pool.element_size()}


def open_pool(shared: dict | None, nbytes: int, peer_name: str) -> torch.Tensor | None:
    """The peer's pool as `nbytes` flat bytes on its GPU, or None where it cannot be opened from here."""
    if not shared or shared.get("boot_id") != boot_id() or not torch.cuda.is_available():
        return None
    try:
        device = int(shared["device"])
        storage = torch.UntypedStorage._new_shared_cuda(
            device, unb64(shared["handle"]), int(shared["size"]), int(shared["offset"]),
            unb64(shared["ref_handle"]), int(shared["ref_offset"]), unb64(shared["event_handle"]) or None,
            bool(shared["event_sync"]))
        start = int(shared["byte_offset"])
        if start < 0 or start + nbytes > storage.nbytes():
            raise ValueError(f"its pool of {nbytes} bytes at {start} lies outside the shared {storage.nbytes()}")
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, start, (nbytes,))
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        log.info("KV pages to %s go through the socket: its GPU pool cannot be opened here (%s)", peer_name, exc)
        return None


def copy_pages(pool: torch.Tensor, dst: torch.Tensor, runs: list[Run]) -> None:
    """Device copies of whole pages into a peer's pool (`dst`, its flat bytes as `open_pool` gave them), finished
    before returning: the peer reads the pages once told."""
    src = pool.reshape(-1).view(torch.uint8)
    pb = src.numel() // pool.shape[0]
    for r in runs:
        dst[r.dst_start * pb:(r.dst_start + r.length) * pb].copy_(
            src[r.src_start * pb:(r.src_start + r.length) * pb], non_blocking=True)
    torch.cuda.current_stream(pool.device).synchronize()


def copy_heads(pool: torch.Tensor, dst: torch.Tensor, dst_kv_heads: int, runs: list[Run],
               parts: list[torch.Tensor], dst_heads: tuple[int, int]) -> None:
    """Device copies of some heads of each page (`parts`, each run's pages cut to them) into heads [dst_heads) of
    a peer's pool of `dst_kv_heads` heads a page."""
    num_pages = dst.numel() // (pool[0].numel() // pool.shape[4] * dst_kv_heads * pool.element_size())
    theirs = dst.view(pool.dtype).view(num_pages, *pool.shape[1:4], dst_kv_heads, pool.shape[5])
    for r, part in zip(runs, parts):
        theirs[r.dst_start:r.dst_start + r.length, :, :, :, dst_heads[0]:dst_heads[1]].copy_(part)
    torch.cuda.current_stream(pool.device).synchronize()
