"""Both backends between two real processes: exact bytes, refusals, dead and stalled peers."""
from __future__ import annotations

import importlib.util
import signal
import time
import uuid

import pytest
import torch

from pdserve.shared.transfer import TransferError, create_transfer
from transfer_peer import PeerProcess, make_pool

# The project installs NIXL everywhere it sets itself up; a bare GPU machine (benchmarks/gpu_check.sh) has none.
BACKENDS = [pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                                          reason="NIXL is not installed here")), "tcp"]


def _name(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def target(backend):
    peer = PeerProcess(backend, _name("decode"))
    yield peer
    peer.stop()


@pytest.fixture
def source(backend):
    transfer = create_transfer(backend, _name("prefill"), make_pool(16, seed=2))
    yield transfer
    transfer.close()


def test_scattered_pages_land_exactly_and_nothing_else_changes(source, target):
    source.add_peer("decode", target.metadata)
    source.add_peer("decode", target.metadata)  # idempotent
    assert source.has_peer("decode")
    src, dst = [3, 4, 5, 10, 0, 1, 15], [7, 8, 9, 20, 2, 3, 31]  # four runs, one ending at the last page
    source.write_pages("decode", src, dst)
    after = target.dump()
    expected = target.initial.clone()
    expected[dst] = source.pool[src]
    assert torch.equal(after.view(torch.int16), expected.view(torch.int16))

    source.pool[3] = 7.0  # the same connection carries the next request
    source.write_pages("decode", [3], [0])
    assert torch.equal(target.dump()[0], source.pool[3])


def test_bad_pages_and_unknown_peers_are_refused(source, target):
    source.add_peer("decode", target.metadata)
    with pytest.raises(TransferError, match="outside the pool of decode"):
        source.write_pages("decode", [0, 1], [31, 32])
    with pytest.raises(TransferError, match="outside this pool"):
        source.write_pages("decode", [16], [0])
    with pytest.raises(TransferError, match="source pages but"):
        source.write_pages("decode", [1, 2], [1])
    with pytest.raises(TransferError, match="not registered"):
        source.write_pages("elsewhere", [0], [0])
    source.remove_peer("decode")
    assert not source.has_peer("decode")
    with pytest.raises(TransferError, match="not registered"):
        source.write_pages("decode", [0], [0])


def test_peer_with_other_page_bytes_or_backend_is_refused(source, backend):
    other = create_transfer(backend, _name("decode"), make_pool(8, seed=3, page_shape=(2, 2, 8, 2, 16)))
    try:
        with pytest.raises(TransferError, match="pages of 2048 bytes for 2 heads, this worker 1024 bytes for 2"):
            source.add_peer("decode", other.metadata())
    finally:
        other.close()
    foreign = "tcp" if backend == "nixl" else "nixl"
    with pytest.raises(TransferError, match=f"uses transfer backend '{foreign}'"):
        source.add_peer("decode", source.metadata().replace(backend.encode(), foreign.encode(), 1))
    assert not source.has_peer("decode")


def test_some_heads_of_each_page_land_in_the_peers_heads_and_nothing_else_changes(source, backend):
    """Tensor-parallel peers: a rank of 2 KV heads writes into a rank of 3, head ranges on both sides."""
    peer = PeerProcess(backend, _name("decode"), num_pages=12, page_shape=(2, 2, 4, 3, 16))
    try:
        source.add_peer("decode", peer.metadata)
        src, dst = [3, 4, 9, 0], [5, 6, 11, 1]
        source.write_heads("decode", src, dst, (0, 2), (1, 3))
        source.write_heads("decode", [7], [0], (1, 2), (0, 1))
        expected = peer.initial.clone()
        expected[dst, :, :, :, 1:3] = source.pool[src]
        expected[0, :, :, :, 0:1] = source.pool[7, :, :, :, 1:2]
        assert torch.equal(peer.dump().view(torch.int16), expected.view(torch.int16))
        with pytest.raises(TransferError, match="write_heads moves some of them"):
            source.write_pages("decode", [0], [0])
        with pytest.raises(TransferError, match="not as many"):
            source.write_heads("decode", [0], [0], (0, 2), (0, 1))
    finally:
        peer.stop()


def test_heads_into_a_peer_holding_just_those_heads_land_whole(source, backend, monkeypatch):
    """A wide rank into a narrower one (2 heads a page into 1): NIXL packs them into the peer's page layout first,
    a few pages at a time here (its staging buffer cut to 3 pages of the peer's)."""
    if backend == "nixl":
        from pdserve.shared.transfer import nixl

        monkeypatch.setattr(nixl, "STAGING_BYTES", 3 * source.page_bytes // 2)
    peer = PeerProcess(backend, _name("decode"), num_pages=12, page_shape=(2, 2, 4, 1, 16))
    try:
        source.add_peer("decode", peer.metadata)
        src, dst = [3, 4, 5, 9, 0, 1, 2], [5, 6, 7, 11, 0, 1, 3]
        source.write_heads("decode", src, dst, (1, 2), (0, 1))
        expected = peer.initial.clone()
        expected[dst] = source.pool[src][:, :, :, :, 1:2]
        assert torch.equal(peer.dump().view(torch.int16), expected.view(torch.int16))
    finally:
        peer.stop()


def test_killed_peer_raises_within_the_timeout_and_a_restarted_one_works(source, backend):
    name = _name("decode")
    peer = PeerProcess(backend, name)
    try:
        source.add_peer(name, peer.metadata)
        source.write_pages(name, [1, 2], [1, 2])
        peer.signal(signal.SIGKILL)
        peer.proc.join(5)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            source.write_pages(name, [1, 2], [1, 2], timeout=3.0)
        assert time.monotonic() - t0 < 3.5
    finally:
        peer.stop()
    peer = PeerProcess(backend, name, seed=4)  # same name, new address
    try:
        source.add_peer(name, peer.metadata)
        source.write_pages(name, [5], [6])
        assert torch.equal(peer.dump()[6], source.pool[5])
    finally:
        peer.stop()


def test_stalled_peer_times_out_instead_of_hanging(source, target):
    target.signal(signal.SIGSTOP)  # alive but never answers (nor polls)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            source.add_peer("stalled", target.metadata, timeout=1.0)
        assert 0.9 < time.monotonic() - t0 < 2.0
        assert not source.has_peer("stalled")
    finally:
        target.signal(signal.SIGCONT)
    source.add_peer("stalled", target.metadata)  # once it runs again, it can be reached
    source.write_pages("stalled", [9], [9])
    assert torch.equal(target.dump()[9], source.pool[9])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PAGE_SHAPES = pytest.mark.parametrize("page_shape", [(2, 2, 4, 2, 16), (4, 2, 16, 8, 64)],
                                      ids=["1KiB-pages", "1MiB-pages"])


def exchange_cuda_pages(backend: str, page_shape: tuple[int, ...], route: str | None) -> None:
    """A GPU pool's pages written into a peer process's GPU pool land exactly (by `route`, for TCP)."""
    source = create_transfer(backend, _name("prefill"), make_pool(16, seed=2, page_shape=page_shape).cuda())
    peer = PeerProcess(backend, _name("decode"), device="cuda", page_shape=page_shape)
    try:
        source.add_peer("decode", peer.metadata)
        if route is not None:
            assert source.route("decode") == route
        src, dst = [0, 1, 2, 12] + list(range(3, 12)), [30, 31, 5, 0] + list(range(7, 16))  # last run: 9 pages
        source.write_pages("decode", src, dst)
        expected = peer.initial.clone()
        expected[dst] = source.pool[src].cpu()
        assert torch.equal(peer.dump().view(torch.int16), expected.view(torch.int16))
    finally:
        peer.stop()
        source.close()


@CUDA
@PAGE_SHAPES
def test_cuda_pools_exchange_pages(backend, page_shape):
    """GPU pools on one host: NIXL registers VRAM; TCP writes the peer's pool by device copies (CUDA IPC)."""
    exchange_cuda_pages(backend, page_shape, "cuda_ipc" if backend == "tcp" else None)


@CUDA
@PAGE_SHAPES
def test_tcp_stages_gpu_pages_through_host_memory_to_another_host(page_shape, monkeypatch):
    """A peer whose IPC handle comes from another host (a foreign boot id) gets the pages over the socket, staged
    through pinned host memory (runs of 1 MiB pages span several chunks)."""
    from pdserve.shared.transfer import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "boot_id", lambda: "another-host")
    exchange_cuda_pages("tcp", page_shape, "socket")
