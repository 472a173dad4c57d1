"""The TCP KV receiver lets in only senders that hold the cluster token, and writes only pages in an open window.

Both ends are real TcpTransfer objects on loopback sockets in this process."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.shared.transfer import TransferError
from pdserve.shared.transfer.tcp import TcpTransfer
from transfer_peer import make_pool

TOKEN = "cluster-token-for-the-test-3f9a"


@pytest.fixture
def pair():
    made: list[TcpTransfer] = []

    def make(name: str, token: str | None, seed: int) -> TcpTransfer:
        made.append(TcpTransfer(name, make_pool(16, seed), token=token))
        return made[-1]

    yield make
    for t in made:
        t.close()


def test_a_sender_without_the_token_is_refused_and_writes_nothing(pair):
    receiver = pair("decode", TOKEN, seed=1)
    receiver.open_window(list(range(16)))
    before = receiver.pool.clone()
    for wrong in ("", "another-clusters-token"):
        sender = pair("prefill", wrong, seed=2)
        with pytest.raises(TransferError, match="does not hold this cluster's token"):
            sender.add_peer("decode", receiver.metadata())
    assert torch.equal(receiver.pool, before)


def test_a_sender_with_the_token_writes_the_pages_of_open_windows_only(pair):
    receiver = pair("decode", TOKEN, seed=1)
    sender = pair("prefill", TOKEN, seed=2)
    sender.add_peer("decode", receiver.metadata())
    receiver.open_window([3, 4])
    sender.write_pages("decode", [0, 1], [3, 4])
    assert torch.equal(receiver.pool[3:5], sender.pool[0:2])

    receiver.close_window([3, 4])  # the request was aborted: its pages may go to another request
    before = receiver.pool.clone()
    with pytest.raises(TransferError, match="not reserved for a transfer"):
        sender.write_pages("decode", [5, 6], [3, 4])
    with pytest.raises(TransferError, match="not reserved for a transfer"):
        sender.write_pages("decode", [7], [9])  # never asked for
    assert torch.equal(receiver.pool, before)
    receiver.open_window([9])
    sender.write_pages("decode", [7], [9])  # the connection was dropped after the refusal: a new one proves again
    assert torch.equal(receiver.pool[9], sender.pool[7])


def test_closing_a_window_waits_for_a_write_already_under_way(pair):
    """A write that started before the window closed ends before close_window returns: none of its bytes can
    land once the pages belong to someone else."""
    receiver = pair("decode", TOKEN, seed=1)
    sender = pair("prefill", TOKEN, seed=2)
    sender.add_peer("decode", receiver.metadata())
    receiver.open_window([2])
    writing = threading.Event()
    real_receive = receiver._receive

    def slow_receive(*args):
        writing.set()
        time.sleep(0.5)
        real_receive(*args)

    receiver._receive = slow_receive
    writer = threading.Thread(target=sender.write_pages, args=("decode", [1], [2]))
    writer.start()
    assert writing.wait(5)
    start = time.monotonic()
    receiver.close_window([2])
    assert time.monotonic() - start > 0.3
    assert torch.equal(receiver.pool[2], sender.pool[1])  # the write was complete when the window closed
    writer.join(5)


def test_without_a_token_on_either_side_transfers_work_as_before(pair):
    receiver = pair("decode", None, seed=1)
    sender = pair("prefill", None, seed=2)
    sender.add_peer("decode", receiver.metadata())
    receiver.open_window([0])
    sender.write_pages("decode", [5], [0])
    assert torch.equal(receiver.pool[0], sender.pool[5])
