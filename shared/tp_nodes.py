"""A tensor-parallel worker over several machines: which ranks each node holds, and how they meet.

`--nnodes K --node-rank R --dist-init-addr HOST:PORT` (SGLang's flags) with `--tp-size N`: node R holds ranks
R*N/K .. (R+1)*N/K - 1. Node 0 runs the worker everyone talks to (its engine process is rank 0); every other node
runs only its ranks (shared/tp_remote.py). They meet at HOST:PORT, where rank 0 serves torch.distributed's
TCPStore behind a gate that lets in only a holder of the cluster token (`master_store`, shared/tp_gate.py; bound to
HOST only): each other node links (shared/tp_link.py: rank 0 grants each node number once, within --nnodes) and
tells its settings, each rank says it joined (once: a rank joined twice is a `NodeClaimError`), and rank 0 says the
group is formed once every rank and every node is there and every node's settings are its own; only then do the
ranks build their process group (gloo on CPUs, NCCL on GPUs) on the same store. A node started again while an
earlier group still stands is refused, so a group is never joined half-way through its life.

With a cluster token what goes through the store is checked too: each post (shared/tp_channel.py) and each node's
settings carry a tag, HMAC-SHA256(token, key NUL value) cut to TAG_BYTES, that its reader verifies before using it
(a post replayed under another key fails it). Whatever a peer sends is parsed, never unpickled: the settings are
JSON of strings, the posts int64s, the ranks' exchanges bytes through tensors (shared/tp_group.py).

The torch imports are inside the functions: a worker's front parses these flags without loading torch.
"""
from __future__ import annotations

import datetime
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
FORMED, LINK = "formed", "link"  # store keys: the group stands; rank 0's liveness port
TAG_BYTES = 16  # of a post's or settings' HMAC-SHA256
_TRY_S = 10.0  # one try at reaching rank 0's store (a node's tunnel may be refused meanwhile)


class NodeClaimError(ValueError):
    """A node number or rank that rank 0 did not grant: not a node of this worker, or one already there (two
    machines started with the same --node-rank?)."""


@dataclass(frozen=True)
class Nodes:
    """The machines of one tensor-parallel worker, as this machine sees them."""

    count: int  # --nnodes
    rank: int  # --node-rank: this machine's
    host: str  # rank 0's node, where the ranks meet (--dist-init-addr, else MASTER_ADDR)
    port: int
    size: int  # --tp-size: the ranks on all the nodes

    @property
    def per_node(self) -> int:
        return self.size // self.count

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    @property
    def local(self) -> range:
        """The ranks this node runs."""
        return self.ranks_of(self.rank)

    def describe(self) -> str:
        first, last = self.local[0], self.local[-1]
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        return f"node {self.rank} of {self.count} ({ranks} of {self.size}), meeting at {self.host}:{self.port}"


def plan_nodes(size: int, count: int, rank: int, addr: str | None, environ=os.environ) -> Nodes | None:
    """The nodes of a worker from its flags (None: one machine). A ValueError names the numbers for what cannot
    be: a node rank not below the node count, ranks that do not spread evenly, no place to meet."""
    if count < 1:
        raise ValueError(f"--nnodes must be at least 1, got {count}")
    if not 0 <= rank < count:
        raise ValueError(f"--node-rank {rank} is not a node of --nnodes {count} (nodes are numbered 0 to "
                         f"{count - 1})")
    if count == 1:
        return None
    if size % count:
        raise ValueError(f"--tp-size {size} does not spread evenly over --nnodes {count}: each node holds the same "
                         f"number of ranks, so the size must be a multiple of the nodes")
    if addr:
        host, port = parse_addr(addr, "--dist-init-addr")
    elif environ.get("MASTER_ADDR"):
        if not environ.get("MASTER_PORT"):
            raise ValueError(f"--nnodes {count}: MASTER_ADDR={environ['MASTER_ADDR']} is set but MASTER_PORT is not")
        host, port = parse_addr(f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}", "MASTER_ADDR:MASTER_PORT")
    else:
        raise ValueError(f"--nnodes {count} needs the address where the ranks meet: --dist-init-addr HOST:PORT (rank "
                         f"0's node and a free port there), or MASTER_ADDR and MASTER_PORT in the environment")
    return Nodes(count, rank, host, port, size)


def parse_addr(addr: str, what: str) -> tuple[str, int]:
    """HOST:PORT, tcp://HOST:PORT or [IPv6]:PORT -> (host, port)."""
    text = addr.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {addr!r} is not HOST:PORT")
    return host, int(port)


# ------------------------------------------------------------------------------------------------ the store
def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def tag(token: str, key: str, value: bytes) -> bytes:
    """What vouches for `value` under store key `key`: only a holder of the cluster token can make it."""
    from pdserve.shared.cluster_auth import proof

    return proof(token, key.encode() + b"\0" + value)[:TAG_BYTES]


def master_store(nodes: Nodes, timeout_s: float):
    """Rank 0: the store the ranks meet at (on loopback) and its gate on --dist-init-addr's address and port."""
    from pdserve.shared.cluster_auth import TOKEN_ENV, cluster_token, loopback_only
    from pdserve.shared.tp_gate import Gate, loopback_store

    if cluster_token() is None and not loopback_only(nodes.host):
        log.warning("no cluster token (%s): any process that reaches %s:%d may read and write this worker's "
                    "rendezvous, and any that reaches its liveness link may claim to be one of its nodes", TOKEN_ENV,
                    nodes.host, nodes.port)
    store = loopback_store(timeout_s)
    return store, Gate(nodes.host, nodes.port, store.port)


def client_store(port: int, timeout_s: float, where: str, refused=lambda: None):
    """Another rank or node: rank 0's store through loopback `port` (rank 0's own store on node 0, the node's
    tunnel on the others), once it is up (tried again until `timeout_s`); RankGone at once when rank 0's gate
    refused this node (`refused()` says why)."""
    import torch.distributed as dist

    from pdserve.shared.tp_group import RankGone

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store = dist.TCPStore("127.0.0.1", port, None, False, timeout=_timeout(min(_TRY_S, timeout_s)))
            store.set_timeout(_timeout(timeout_s))
            return store
        except (RuntimeError, OSError) as exc:
            if refused():
                raise RankGone(refused()) from None
            if time.monotonic() > deadline:
                raise RankGone(f"no tensor-parallel rank 0 at {where} within {timeout_s:g} s: {exc}") from None


def refuse_late_node(store, nodes: Nodes) -> None:
    """A node started again while the group it was part of still stands cannot join it: the worker's rank 0
    notices this node's earlier process is gone and exits, and the next start meets afresh."""
    from pdserve.shared.tp_group import RankGone

    if store.check([FORMED]):
        raise RankGone(f"the worker at {nodes.host}:{nodes.port} already formed its group "
                       f"(an earlier start of this node?); it stops once it misses this node's ranks, and the next "
                       f"start meets afresh")


def join(store, rank: int, alive, timeout_s: float) -> None:
    """A rank other than 0: say it joined, and wait until rank 0 says the group is formed."""
    store.add(f"joined/{rank}", 1)
    _wait(lambda: store.check([FORMED]), alive, timeout_s, lambda: f"rank {rank} waiting for rank 0 to form the group")


def settings_of(config, backend: str | None) -> dict[str, str]:
    """What every node must agree on: the runtime settings from its flags (all but the model's path, which may
    be mounted elsewhere) and its KV transfer backend."""
    from dataclasses import fields

    mine = {f.name: repr(getattr(config, f.name)) for f in fields(config) if f.name != "model_path"}
    return {**mine, "transfer_backend": backend or "none"}


def tell_settings(store, node: int, settings: dict[str, str]) -> None:
    """A node's settings for rank 0: a line with their tag (empty without a cluster token), then their json."""
    from pdserve.shared.cluster_auth import cluster_token

    key, body, token = f"settings/{node}", json.dumps(settings).encode(), cluster_token()
    store.set(key, (tag(token, key, body).hex().encode() if token else b"") + b"\n" + body)


def told_settings(store, node: int) -> dict[str, str]:
    """Rank 0: what node `node` told, once its tag is checked (a ValueError when it fails)."""
    from pdserve.shared.cluster_auth import TOKEN_ENV, cluster_token

    key, token = f"settings/{node}", cluster_token()
    mark, _, body = store.get(key).partition(b"\n")
    if token is None and mark:
        raise ValueError(f"node {node} holds a cluster token and node 0 none: give every node of a worker the same "
                         f"{TOKEN_ENV}")
    if token is not None and not hmac.compare_digest(mark, tag(token, key, body).hex().encode()):
        raise ValueError(f"node {node}'s settings failed their check: was it started without this worker's cluster "
                         f"token ({TOKEN_ENV}), or with another? (or they were written by a process without it)")
    try:
        settings = json.loads(body)
    except ValueError:
        settings = None
    if not isinstance(settings, dict) or not all(isinstance(v, str) for v in settings.values()):
        raise ValueError(f"node {node}'s settings are not a JSON object of strings: not a pdserve node's")
    return settings


def check_settings(store, nodes: Nodes, mine: dict[str, str]) -> None:
    """Rank 0: a ValueError naming the settings where another node's flags differ from this one's, or that
    failed their check."""
    for node in range(1, nodes.count):
        theirs = told_settings(store, node)
        differ = [f"{k} ({theirs.get(k)} there, {v} here)" for k, v in mine.items() if theirs.get(k) != v]
        if differ:
            raise ValueError(f"node {node} was started with other flags than node 0: {'; '.join(differ)}. Start "
                             "every node of a worker with the same flags but --node-rank")


def form(store, size: int, nodes_linked, alive, timeout_s: float, check=lambda: None) -> None:
    """Rank 0: wait until every rank joined and `nodes_linked()` (every other node's liveness link is up), then
    `check()` what they told and say the group is formed. `alive()` raises when a rank or node is gone
    meanwhile."""
    store.set("joined/0", b"1")  # (rank 0 is this process: it forms once)
    keys = [f"joined/{r}" for r in range(size)]
    told = [False]

    def ready() -> bool:
        if store.check(keys) and nodes_linked():
            return True
        if not told[0]:
            told[0] = True
            log.info("tensor-parallel rank 0: waiting for the other nodes' ranks to join")
        return False

    def missing() -> str:
        gone = [r for r in range(size) if not store.check([f"joined/{r}"])]
        return f"rank 0 waiting for rank(s) {gone} to join"

    _wait(ready, alive, timeout_s, missing)
    twice = {r: n for r, key in enumerate(keys) if (n := int(store.get(key))) != 1}
    if twice:
        raise NodeClaimError("; ".join(f"rank {r} joined {n} times" for r, n in twice.items()) + ": two machines "
                             "started with the same --node-rank? (each rank is one process of one node)")
    check()
    store.set(FORMED, b"1")


def _wait(ready, alive, timeout_s: float, what) -> None:
    import torch.distributed as dist

    from pdserve.shared.tp_group import RankGone

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except dist.DistNetworkError as exc:  # (a rank's only: rank 0's store is in rank 0's process)
            raise RankGone(f"tensor-parallel {what()}: rank 0 is gone ({exc})") from None
        alive()
        if time.monotonic() > deadline:
            raise RankGone(f"tensor-parallel {what()}: nothing for {timeout_s:g} s")
        time.sleep(0.05)
