"""The doors of a tensor-parallel worker over several machines, on loopback: two gloo ranks form their group
through rank 0's gate while processes without the cluster token try the store (refused, a rank with another token
told why at once), a pickled payload a rank sends arrives as bytes and is never unpickled, the gate and the link
listen on the configured address only, and both keep their doors open through a process out of descriptors."""
from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from pdserve.shared.cluster_auth import TOKEN_ENV, TOKEN_FILE_ENV, proof
from pdserve.shared.tp_gate import OPEN, REFUSED, Gate, loopback_store, read_line
from pdserve.shared.tp_link import LINKED, answer

TOKEN = "test-cluster-token-81c3e0"

# One rank of a 2-rank worker meeting at 127.0.0.1:PORT: rank 0 serves the store behind the gate, rank 1 reaches
# it through its tunnel; then they exchange bytes, rank 1 a pickle that would create MARKER if it were unpickled.
RANK = """
import json, pickle, sys, torch
import torch.distributed as dist
from pdserve.shared.tp_gate import Tunnel
from pdserve.shared.tp_group import RankGone, TorchGroup
from pdserve.shared.tp_nodes import Nodes, client_store, form, join, master_store
rank, port, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
nodes = Nodes(2, rank, "127.0.0.1", port, 2)
try:
    if rank == 0:
        store, gate = master_store(nodes, 60)
        print("up", flush=True)
        form(store, 2, lambda: True, lambda: None, 60)
    else:
        tunnel = Tunnel("127.0.0.1", port)
        if (why := tunnel.reach(60)) is not None:
            raise RankGone(why)
        store = client_store(tunnel.port, 60, f"127.0.0.1:{port}", lambda: tunnel.refused)
        join(store, 1, lambda: None, 60)
except RankGone as exc:
    print(exc, flush=True)
    sys.exit(3)
group = TorchGroup(rank, 2, "", 60, torch.device("cpu"), dist.PrefixStore("group/", store))

class Planted:
    def __reduce__(self):
        return (open, (marker, "w"))

mine = pickle.dumps(Planted()) if rank == 1 else json.dumps({"rank": 0}).encode()
print(json.dumps([part.hex() for part in group.all_gather_bytes(mine, 60)]), flush=True)
"""


@pytest.fixture(autouse=True)
def no_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank(r: int, port: int, marker, token: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), str(marker)], stdout=subprocess.PIPE,
                            text=True, env={**_env(), TOKEN_ENV: token})


def _env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}


def knock(port: int, token: str | None) -> str:
    """A hand-made hello at the gate: what it answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        nonce = bytes.fromhex(read_line(sock))
        sock.sendall(proof(token, nonce + b"store").hex().encode() + b"\n")
        return read_line(sock)


def test_two_ranks_meet_through_the_gate_while_processes_without_the_token_are_refused(tmp_path):
    port, marker = free_port(), tmp_path / "unpickled"
    rank0 = rank(0, port, marker, TOKEN)
    stranger = rank(1, port, marker, "another-token")  # a rank 1 with another token: told why once rank 0 is up
    procs = [rank0, stranger]
    try:
        assert rank0.stdout.readline().strip() == "up"
        with pytest.raises(dist.DistNetworkError):  # torch's own client, straight at the port: no key, no count
            dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=2))
        said = knock(port, "another-token")
        assert said.startswith(REFUSED) and "does not prove this worker's cluster token" in said
        assert knock(port, TOKEN) == OPEN
        assert stranger.wait(60) == 3
        assert "refused this node: its answer does not prove this worker's cluster token" in stranger.stdout.read()
        rank1 = rank(1, port, marker, TOKEN)
        procs.append(rank1)
        assert rank0.wait(90) == 0 and rank1.wait(30) == 0
        got = [json.loads(p.stdout.read()) for p in (rank0, rank1)]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert got[0] == got[1]
    parts = [bytes.fromhex(h) for h in got[0]]
    assert json.loads(parts[0]) == {"rank": 0}
    assert parts[1].startswith(b"\x80") and b"Planted" not in parts[1]  # rank 1's pickle, kept as bytes
    assert not marker.exists()  # never unpickled
    with pytest.raises(ValueError):
        json.loads(parts[1])  # and its readers' schema refuses it


def test_the_gate_and_the_store_listen_on_the_configured_address_only():
    store = loopback_store(10)
    assert store.host == "127.0.0.1"
    gate = Gate("127.0.0.2", 0, store.port)  # an address of this machine other than 127.0.0.1
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", gate.port), timeout=2)
        with socket.create_connection(("127.0.0.2", gate.port), timeout=2) as sock:
            assert len(bytes.fromhex(read_line(sock))) == 32  # its challenge
    finally:
        gate.close()
    with pytest.raises(ValueError, match="cannot listen for the ranks' rendezvous .* on 192.0.2.1:"):
        Gate("192.0.2.1", 0, store.port)  # not an address of this machine: a start error, not every interface


# A process out of descriptors: its gate's and its link's accepts fail (EMFILE) until it frees some.
CROWDED = """
import os, resource, sys
from pdserve.shared.tp_gate import Gate, loopback_store
from pdserve.shared.tp_link import Link
store = loopback_store(30)
gate = Gate("127.0.0.1", 0, store.port)
link = Link.listen(30.0, "127.0.0.1", range(1, 2))
link.start()
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(open(os.devnull))
except OSError:
    pass
print(gate.port, link.port, flush=True)
sys.stdin.readline()  # both doors knocked at
import time; time.sleep(1.0)
for f in held:
    f.close()
sys.stdin.readline()
print(gate.door.refused, link.door.refused, sorted(link.peers), flush=True)
"""


def test_both_doors_stay_open_through_a_process_out_of_descriptors():
    proc = subprocess.Popen([sys.executable, "-c", CROWDED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        gate_port, link_port = map(int, proc.stdout.readline().split())
        at_gate = socket.create_connection(("127.0.0.1", gate_port), timeout=10)
        at_link = socket.create_connection(("127.0.0.1", link_port), timeout=10)
        at_gate.settimeout(0.5)
        with pytest.raises(TimeoutError):
            at_gate.recv(1)  # not accepted: no descriptor for it
        proc.stdin.write("knocked\n")
        proc.stdin.flush()
        at_gate.settimeout(10)
        nonce = bytes.fromhex(read_line(at_gate))  # accepted once descriptors are free again
        at_gate.sendall(proof(None, nonce + b"store").hex().encode() + b"\n")
        assert read_line(at_gate) == OPEN
        nonce = bytes.fromhex(read_line(at_link))
        at_link.sendall(f"{answer(None, nonce, 1)}\n".encode())
        assert read_line(at_link) == LINKED
        proc.stdin.write("done\n")
        proc.stdin.flush()
        gate_refused, link_refused, peers = proc.stdout.readline().split(" ", 2)
        assert int(gate_refused) > 0 and int(link_refused) > 0 and peers.strip() == "[1]"
        assert proc.wait(10) == 0
        err = proc.stderr.read()
        assert "cannot accept a connection (Too many open files)" in err and "Traceback" not in err
        at_gate.close()
        at_link.close()
    finally:
        proc.kill()
        proc.wait()


class Peers:
    """torch.distributed as a rank sees it when the other rank claims `claimed` bytes: only the lengths come."""

    def __init__(self, claimed: int) -> None:
        self.claimed, self.calls = claimed, 0

    def all_gather(self, out, mine) -> None:
        self.calls += 1
        out[0].copy_(mine)
        out[1].fill_(self.claimed)


@pytest.mark.parametrize("claimed", [-1, (1 << 20) + 1, 1 << 40])
def test_a_length_no_rank_sends_is_refused_before_anything_is_allocated_for_it(claimed):
    import torch

    from pdserve.shared.tp_bytes import BadExchange, gather_bytes

    peers = Peers(claimed)
    with pytest.raises(BadExchange, match=f"claims a length outside 0..1048576 bytes \\(rank 1: {claimed}\\)"):
        gather_bytes(peers, b"{}", 2, torch.device("cpu"))
    assert peers.calls == 1  # the bytes themselves were never asked for
