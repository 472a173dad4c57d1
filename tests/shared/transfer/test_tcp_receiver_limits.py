"""What a host that reaches a worker's TCP KV port can cost it without the cluster token.

Connections that never prove anything are few at a time and short-lived; running the receiver out of file
descriptors stalls accepting only while it lasts; a peer that registered keeps writing through all of it.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import torch

from pdserve.shared.transfer.tcp import MAX_UNPROVEN, TcpTransfer
from transfer_peer import PeerProcess, make_pool

TOKEN = "cluster-token-for-the-limits-test-71c2"


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def receiver_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kv-tcp-recv")


def test_silent_connections_are_capped_and_dropped_while_a_registered_peer_keeps_writing():
    receiver = TcpTransfer("decode", make_pool(16, 1), token=TOKEN, handshake_timeout=1.0)
    sender = TcpTransfer("prefill", make_pool(16, 2), token=TOKEN)
    silent: list[socket.socket] = []
    try:
        receiver.open_window(list(range(16)))
        sender.add_peer("decode", receiver.metadata())
        for _ in range(200):  # connections that never answer the challenge
            silent.append(socket.create_connection(("127.0.0.1", receiver.port), timeout=5))
        time.sleep(0.3)
        assert receiver_threads() <= MAX_UNPROVEN + 1  # the registered peer's connection, and at most the cap
        sender.write_pages("decode", [3, 4], [5, 6], timeout=5)  # its connection was proven before the flood
        assert torch.equal(receiver.pool[5:7], sender.pool[3:5])
        # Beyond the cap they were closed at once; the rest are dropped at the handshake deadline.
        assert wait_until(lambda: receiver_threads() <= 1, timeout=5)
        for s in silent:
            s.settimeout(2)
            try:
                while s.recv(4096):  # the challenge, if it got one, then the close
                    pass
            except OSError:
                pass
        late = TcpTransfer("prefill-2", make_pool(16, 3), token=TOKEN)
        try:
            late.add_peer("decode", receiver.metadata(), timeout=5)  # a new peer registers after the flood
            late.write_pages("decode", [0], [9], timeout=5)
            assert torch.equal(receiver.pool[9], late.pool[0])
        finally:
            late.close()
        assert receiver.healthy()
    finally:
        for s in silent:
            s.close()
        sender.close()
        receiver.close()


def test_the_receiver_accepts_again_after_running_out_of_file_descriptors(capfd):
    peer = PeerProcess("tcp", "decode", num_pages=16)
    sender = TcpTransfer("prefill", make_pool(16, 2))
    knocks: list[socket.socket] = []
    try:
        address = json.loads(peer.metadata)
        peer.conn.send("exhaust_fds")
        assert peer._recv(30) > 0
        for _ in range(3):  # connections it cannot accept while it has no descriptor left
            knocks.append(socket.create_connection((address["host"], address["port"]), timeout=5))
        assert wait_until(lambda: "accepting connections fails" in capfd.readouterr().err, timeout=10)
        peer.conn.send("release_fds")
        assert peer._recv(10)
        sender.add_peer("decode", peer.metadata, timeout=10)  # the accept loop lived through it
        sender.write_pages("decode", [1, 2], [7, 8], timeout=10)
        assert torch.equal(peer.dump()[7:9], sender.pool[1:3])
        peer.conn.send("healthy")
        assert peer._recv(10) is True
    finally:
        for s in knocks:
            s.close()
        sender.close()
        peer.stop()
