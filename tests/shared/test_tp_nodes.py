"""The parts of a tensor-parallel worker over several machines, each alone on loopback: the posts through the
rendezvous store arrive in order with their payloads and are cleaned up behind; a follower waiting for a post
hears at once that rank 0's process is gone, and runs its idle work meanwhile; the liveness link between nodes
says which node is gone and why (its connection closed, the reason it sent, or silence past the timeout)."""
from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pdserve.shared.tp_channel import StoreBox
from pdserve.shared.tp_group import RankGone
from pdserve.shared.tp_link import Link
from pdserve.shared.tp_nodes import Nodes, form, join


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stores() -> tuple:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    return master, dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))


def test_posts_arrive_in_order_with_their_payloads_and_old_ones_are_removed():
    master, client = stores()
    leader, follower = StoreBox(master, 0, 2), StoreBox(client, 1, 2)
    # (each post is read before the next but one: a collective of every rank follows every post)
    leader.post(3, [256])
    leader.post(1, [1, 7, 2], torch.tensor([10, 11, 12], dtype=torch.int32))
    assert follower.fetch(5.0) == (3, [256])
    assert follower.fetch(5.0) == (1, [1, 7, 2])
    assert follower.payload.dtype == torch.int64 and follower.payload.tolist() == [10, 11, 12]
    leader.post(2, [])
    assert follower.fetch(5.0) == (2, []) and follower.payload.numel() == 0
    assert not master.check(["post/1"]) and master.check(["post/2", "post/3"])  # read by every rank by now
    with pytest.raises(ValueError, match="holds 32 integers"):
        leader.post(1, list(range(33)))


def test_a_follower_waits_doing_its_idle_work_and_gives_up_after_its_timeout():
    master, client = stores()
    follower = StoreBox(client, 1, 2)
    calls = []
    start = time.monotonic()
    with pytest.raises(RankGone, match="no word from rank 0 for 0.3 s"):
        follower.fetch(0.3, idle=lambda: calls.append(1))
    assert 0.25 < time.monotonic() - start < 3
    assert len(calls) >= 3  # its KV agent progressed while it waited
    StoreBox(master, 0, 2).post(5, [1])
    assert follower.fetch(1.0) == (5, [1])  # a wait that timed out left the connection usable


def test_a_follower_hears_at_once_that_rank_0_is_gone():
    port = free_port()
    rank0 = subprocess.Popen([sys.executable, "-c", (
        "import datetime, time, torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, None, True, timeout=datetime.timedelta(seconds=10), "
        "wait_for_workers=False); s.set('up', b'1'); time.sleep(60)")])
    try:
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
        client.wait(["up"])
        follower = StoreBox(client, 1, 2)
        rank0.kill()
        start = time.monotonic()
        with pytest.raises(RankGone, match="rank 0 is gone"):
            follower.fetch(None)  # no timeout: it waits as long as rank 0 is there
        assert time.monotonic() - start < 10  # its connection closed: not the end of its 30 s wait
    finally:
        rank0.kill()
        rank0.wait()


def test_rank_0_forms_the_group_once_every_rank_joined_and_every_node_linked():
    master, client = stores()
    linked = [False]
    with pytest.raises(RankGone, match=r"rank\(s\) \[1\] to join"):
        form(master, 2, lambda: True, lambda: None, 0.2)
    join_errors = []

    def follower() -> None:
        try:
            join(client, 1, lambda: None, 10.0)
        except RankGone as exc:
            join_errors.append(exc)

    t = threading.Thread(target=follower)
    t.start()
    with pytest.raises(RankGone, match="node gone"):
        form(master, 2, lambda: linked[0], lambda: (_ for _ in ()).throw(RankGone("node gone")), 5.0)
    linked[0] = True
    form(master, 2, lambda: linked[0], lambda: None, 5.0)
    t.join(10)
    assert not t.is_alive() and not join_errors


def test_nodes_hold_even_runs_of_ranks():
    nodes = Nodes(count=2, rank=1, host="10.0.0.1", port=5000, size=4)
    assert list(nodes.ranks_of(0)) == [0, 1] and list(nodes.local) == [2, 3]
    assert nodes.describe() == "node 1 of 2 (ranks 2-3 of 4), meeting at 10.0.0.1:5000"


# ------------------------------------------------------------------------------------------------ the liveness link
def until(predicate, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def rank0_end():
    link = Link.listen(timeout_s=1.5)
    link.start()
    yield link
    link.close()


def test_a_node_whose_process_dies_is_gone_at_once(rank0_end):
    node = Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
    until(lambda: rank0_end.linked([1]))
    rank0_end.check()
    node.poll(0.1)
    node.close()  # what the kernel does for a killed process
    assert until(lambda: rank0_end.lost is not None) < 1.0
    with pytest.raises(RankGone, match=r"tensor-parallel node 1 \(127.0.0.1\) is gone: its connection"):
        rank0_end.check()


def test_a_node_says_why_it_leaves(rank0_end):
    node = Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
    until(lambda: rank0_end.linked([1]))
    node.say("tensor-parallel rank 3 exited (code 1)")
    until(lambda: rank0_end.lost is not None)
    assert rank0_end.lost.endswith("is gone: tensor-parallel rank 3 exited (code 1)")
    node.close()


def test_beats_keep_a_link_alive_and_silence_ends_it(rank0_end):
    node = Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
    until(lambda: rank0_end.linked([1]))
    deadline = time.monotonic() + 2.5  # longer than the timeout: only the beats keep it
    while time.monotonic() < deadline:
        node.poll(0.1)
    assert rank0_end.lost is None and node.lost is None
    assert until(lambda: rank0_end.lost is not None) < 3.0  # the node stopped beating
    assert "no word from it for 1.5 s" in rank0_end.lost
    node.close()


def test_a_node_hears_that_rank_0_is_gone_and_a_second_node_1_is_refused(rank0_end):
    node = Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
    until(lambda: rank0_end.linked([1]))
    twin = Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
    until(lambda: (twin.poll(0.05), twin.lost)[1] is not None)
    assert "node 1 is already part of this worker" in twin.lost
    rank0_end.close()
    until(lambda: (node.poll(0.05), node.lost)[1] is not None)
    assert node.lost.startswith("rank 0's node (127.0.0.1:")
    with pytest.raises(RankGone):
        node.check()
