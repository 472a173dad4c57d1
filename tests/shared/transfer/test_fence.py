"""Fences: a revoked or expired fence writes nothing, a revocation waits out a write under way, the receiver's
pages take only their current fence, and a lease's end is known on both sides without shared clocks.

The sender-side check is what guards one-sided writes (NIXL, and CUDA IPC, which needs a GPU: its path is this
same check around `TcpTransfer.write_pages`); the receiver side is exercised over real sockets."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.shared.transfer import TransferError
from pdserve.shared.transfer.fence import WRITE_BOUND_S, Fence, Lease, PeerClock, SenderFences, new_fence
from pdserve.shared.transfer.tcp import TcpTransfer
from transfer_peer import make_pool


def test_a_revoked_or_expired_fence_writes_nothing_and_others_still_do():
    fences = SenderFences()
    wrote = []
    fences.revoke("decode", 7)
    with pytest.raises(TransferError, match="revoked"):
        with fences.writing("decode", Fence(7)):
            wrote.append(7)
    with pytest.raises(TransferError, match="ran out of time"):
        with fences.writing("decode", Fence(8, deadline=time.monotonic() - 0.01)):
            wrote.append(8)
    with fences.writing("other-decode", Fence(7)):  # the same number at another peer is another fence
        wrote.append("other")
    with fences.writing("decode", Fence(9)):
        wrote.append(9)
    assert wrote == ["other", 9]


def test_a_revocation_returns_only_once_the_write_under_way_ended():
    fences = SenderFences()
    started, ended = threading.Event(), []

    def write():
        with fences.writing("decode", Fence(5)):
            started.set()
            time.sleep(0.3)
            ended.append(time.monotonic())

    writer = threading.Thread(target=write)
    writer.start()
    assert started.wait(5)
    assert fences.revoke("decode", 5, wait_s=5)
    revoked_at = time.monotonic()
    writer.join(5)
    assert ended and ended[0] <= revoked_at
    assert fences.revoke("decode", 6, wait_s=0)  # nothing under way: at once


def test_a_revocation_says_so_when_a_write_outlasts_its_wait():
    fences = SenderFences()
    started, release = threading.Event(), threading.Event()

    def write():
        with fences.writing("decode", Fence(5)):
            started.set()
            release.wait(5)

    writer = threading.Thread(target=write)
    writer.start()
    assert started.wait(5)
    assert not fences.revoke("decode", 5, wait_s=0.05)
    release.set()
    writer.join(5)


def test_the_lease_ends_for_the_receiver_after_it_ended_for_the_writer_whatever_the_clocks():
    """The writer's clock is 1,000 s ahead of ours and the registration took 0.2 s each way: the deadline gives
    the writer at least the lease, and the receiver's end of it comes after deadline + WRITE_BOUND_S there."""
    offset, one_way = 1000.0, 0.2
    clock = PeerClock(sent=10.0, theirs=10.0 + one_way + offset, answered=10.0 + 2 * one_way)
    now = 50.0
    deadline = clock.deadline(now, lease_s=30.0)
    assert deadline - (now + offset) >= 30.0  # the writer's clock reads now + offset: it gets the whole lease
    lease = Lease(30.0)
    lease.settled_by = clock.passed_at(deadline + WRITE_BOUND_S)
    assert lease.settled_by + offset >= deadline + WRITE_BOUND_S  # when the writer's clock surely passed it
    assert lease.settled_by - now <= 30.0 + WRITE_BOUND_S + 2 * one_way + 1e-9  # and not much later


def test_a_lease_stamped_twice_ends_after_the_later_one():
    lease = Lease(5.0)
    first = lease.stamp(PeerClock(0.0, 0.0, 0.0))
    end = lease.settled_by
    second = lease.stamp(PeerClock(time.monotonic(), 0.0, time.monotonic()))  # a restarted writer, another clock
    assert first != second and lease.settled_by >= end


def test_fences_are_fresh_and_never_zero():
    drawn = {new_fence() for _ in range(1000)}
    assert len(drawn) == 1000 and 0 not in drawn


def test_the_tcp_receiver_refuses_a_write_of_an_earlier_reservation_of_the_same_pages():
    receiver, sender = TcpTransfer("decode", make_pool(8, 1), token=None), TcpTransfer("prefill", make_pool(8, 2),
                                                                                       token=None)
    try:
        sender.add_peer("decode", receiver.metadata())
        old, new = new_fence(), new_fence()
        receiver.open_window([2, 3], old)
        receiver.close_window([2, 3])  # aborted ...
        receiver.open_window([2, 3], new)  # ... and reserved again for another request
        before = receiver.pool.clone()
        with pytest.raises(TransferError, match="another fence"):
            sender.write_pages("decode", [0, 1], [2, 3], fence=old)
        assert torch.equal(receiver.pool, before)
        sender.write_pages("decode", [4, 5], [2, 3], fence=new)
        assert torch.equal(receiver.pool[2:4], sender.pool[4:6])
    finally:
        sender.close()
        receiver.close()


def test_a_worker_writes_nothing_under_a_revoked_fence_even_into_pages_still_open():
    """The check one-sided routes rely on (NIXL, CUDA IPC), above every backend: the receiver's window is still
    open under the fence, so only the sender's revocation stops the write."""
    from pdserve.shared.tp_transfer import RankTransfers

    def worker(name: str, seed: int) -> RankTransfers:
        agent = TcpTransfer(name, make_pool(8, seed), token=None)
        return RankTransfers(agent, None, [(0, agent.kv_heads)], [agent.metadata()])

    decode, prefill = worker("decode", 1), worker("prefill", 2)
    try:
        prefill.add_peer("decode", decode.metadata())
        fence = decode.open_window([1, 2])
        prefill.write_pages("decode", [3, 4], [1, 2], fence=Fence(fence))
        assert torch.equal(decode.agent.pool[1:3], prefill.agent.pool[3:5])
        assert prefill.revoke("decode", fence)
        before = decode.agent.pool.clone()
        with pytest.raises(TransferError, match="revoked"):
            prefill.write_pages("decode", [5, 6], [1, 2], fence=Fence(fence))
        assert torch.equal(decode.agent.pool, before)
    finally:
        prefill.close()
        decode.close()
