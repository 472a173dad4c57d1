"""The parts of a tensor-parallel worker over several machines, each alone on loopback: the posts through the
rendezvous store arrive in order with their payloads and are cleaned up behind; a follower waiting for a post
hears at once that rank 0's process is gone, and runs its idle work meanwhile; the liveness link between nodes
says which node is gone and why (its connection closed, the reason it sent, or silence past the timeout). With a
cluster token, a post, a node's settings or a link hello from a process without it is refused; a connection that
says nothing holds up no node."""
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

from pdserve.shared import tp_gate, tp_link
from pdserve.shared.cluster_auth import TOKEN_ENV, TOKEN_FILE_ENV
from pdserve.shared.tp_channel import StoreBox
from pdserve.shared.tp_group import RankGone
from pdserve.shared.tp_link import Link, answer
from pdserve.shared.tp_nodes import NodeClaimError, Nodes, check_settings, form, join, tell_settings

TOKEN = "test-cluster-token-3f9a1c"


@pytest.fixture(autouse=True)
def no_token(monkeypatch):
    """Each test starts without a cluster token (a worker started by hand); `token` gives it one."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


@pytest.fixture
def token(monkeypatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


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
    assert len(master.get("post/2")) == 8 * 8  # kind, length, 3 header and 3 payload ints: no tag without a token
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
    link = Link.listen(1.5, "127.0.0.1", range(1, 3))
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
    with pytest.raises(NodeClaimError, match="node 1: rank 0's node at 127.0.0.1:[0-9]+ refused its claim: node 1 is "
                                             "already linked from 127.0.0.1: two machines started with --node-rank 1"):
        Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
    for number in (0, 3, -1):  # rank 0's own, past --nnodes 3, not a number
        with pytest.raises(NodeClaimError, match=f"refused its claim: node {number} is not a node of this worker: "
                                                 r"the others are numbered 1 to 2 \(--nnodes 3\)"):
            Link.connect("127.0.0.1", rank0_end.port, number, timeout_s=1.5)
    assert rank0_end.lost is None and rank0_end.linked([1])
    rank0_end.close()
    until(lambda: (node.poll(0.05), node.lost)[1] is not None)
    assert node.lost.startswith("rank 0's node (127.0.0.1:")
    with pytest.raises(RankGone):
        node.check()


# ------------------------------------------------------------------------------------------------ with a cluster token
@pytest.mark.parametrize("forger", [None, "another-token", "replay"])
def test_with_a_token_a_follower_refuses_a_post_rank_0_did_not_make(token, monkeypatch, forger):
    master, client = stores()
    leader, follower = StoreBox(master, 0, 2), StoreBox(client, 1, 2)
    leader.post(1, [4, 2], torch.tensor([7, 8], dtype=torch.int32))
    assert follower.fetch(5.0) == (1, [4, 2]) and follower.payload.tolist() == [7, 8]  # rank 0's own
    if forger == "replay":
        client.set("post/2", master.get("post/1"))  # a post rank 0 made, under the next key
    else:  # a client of the store without the token, or with another, writes the next post
        monkeypatch.delenv(TOKEN_ENV) if forger is None else monkeypatch.setenv(TOKEN_ENV, forger)
        intruder = StoreBox(client, 0, 2)
        intruder.seen = 1
        intruder.post(1, [4, 9], torch.tensor([666]))
    with pytest.raises(RankGone, match=r"rank 1: a post to the tensor-parallel ranks failed its check: written by "
                                       r"a process without the cluster token\? \(store key 'post/2'"):
        follower.fetch(5.0)


def test_with_a_token_rank_0_checks_the_settings_each_node_tells(token, monkeypatch):
    master, client = stores()
    nodes = Nodes(count=2, rank=0, host="127.0.0.1", port=0, size=2)
    tell_settings(client, 1, {"cache": "a"})
    check_settings(master, nodes, {"cache": "a"})
    with pytest.raises(ValueError, match=r"other flags than node 0: cache \(a there, b here\)"):
        check_settings(master, nodes, {"cache": "b"})
    for other in ("another-token", None):
        monkeypatch.delenv(TOKEN_ENV) if other is None else monkeypatch.setenv(TOKEN_ENV, other)
        tell_settings(client, 1, {"cache": "a"})
        monkeypatch.setenv(TOKEN_ENV, token)
        with pytest.raises(ValueError, match=f"node 1's settings failed their check: .*cluster token \\({TOKEN_ENV}"):
            check_settings(master, nodes, {"cache": "a"})
    tell_settings(client, 1, {"cache": "a"})
    monkeypatch.delenv(TOKEN_ENV)  # node 0 without one
    with pytest.raises(ValueError, match="node 1 holds a cluster token and node 0 none"):
        check_settings(master, nodes, {"cache": "a"})


def hello(port: int, token: str | None, node: int = 1, then=lambda: None) -> str:
    """A hand-made hello to rank 0's end: what it answers (`then()` runs before the connection closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        nonce = bytes.fromhex(tp_gate.read_line(sock))
        sock.sendall(f"{answer(token, nonce, node)}\n".encode())
        said = tp_gate.read_line(sock)
        if said != tp_link.LINKED:
            assert sock.recv(1) == b""  # refused: closed
        then()
        return said


def test_with_a_token_a_hello_that_does_not_prove_it_is_refused_and_the_node_still_links(token, monkeypatch,
                                                                                        caplog):
    rank0_end = Link.listen(1.5, "127.0.0.1", range(1, 3))
    rank0_end.start()
    try:
        assert "does not prove this worker's cluster token" in hello(rank0_end.port, "another-token")
        node = Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
        until(lambda: rank0_end.linked([1]))
        assert "does not prove" in hello(rank0_end.port, "another-token", node=1)  # a forged node 1 while it is up
        monkeypatch.setenv(TOKEN_ENV, "another-token")
        with pytest.raises(RankGone, match="refused its link: its answer does not prove this worker's cluster token"):
            Link.connect("127.0.0.1", rank0_end.port, 2, timeout_s=1.5)
        node.poll(0.1)
        assert rank0_end.lost is None and list(rank0_end.peers) == [1]  # none counted, none leaving
        node.close()
    finally:
        rank0_end.close()
    refusals = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
    assert len(refusals) == 3 and not [r for r in caplog.records if token in r.getMessage()]


def test_without_a_token_any_node_links_as_before(rank0_end):
    linked = []
    assert hello(rank0_end.port, "any-token", node=2, then=lambda: linked.append(rank0_end.linked([2]))) == \
        tp_link.LINKED
    assert linked == [True]


def test_a_connection_that_says_nothing_holds_up_no_node_and_is_closed(token, monkeypatch, rank0_end):
    monkeypatch.setattr(tp_link, "HELLO_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", rank0_end.port), timeout=5) as silent:
        start = time.monotonic()
        node = Link.connect("127.0.0.1", rank0_end.port, 1, timeout_s=1.5)
        assert time.monotonic() - start < 0.5 and rank0_end.linked([1])
        tp_gate.read_line(silent)  # its challenge, unanswered
        assert "did not say which node it is within 0.5 s" in tp_gate.read_line(silent)
        assert silent.recv(1) == b""
    node.poll(0.1)
    assert rank0_end.lost is None and node.lost is None
    node.close()
