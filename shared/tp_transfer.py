"""A worker's KV transfer across its tensor-parallel ranks: each rank's agent moves the heads that rank holds,
straight into the peer's ranks that hold them, whatever the two sides' tensor-parallel sizes.

Every rank has a transfer agent over its own pool (shared/transfer/), so a page's KV never gathers on one rank.
The worker's metadata lists its ranks: each one's KV heads (of the model's) and its agent's metadata. Adding a
peer plans, for each of this worker's ranks, which of the peer's ranks get which of its heads (`plan`): a head
goes to every peer rank holding it (replicated KV heads included), from the first of this worker's ranks that
holds it. A pair of equal head ranges moves whole pages; any other overlap moves those heads of each page
(`KVTransfer.write_heads`).

Rank 0 is the worker's face: its `RankTransfers` posts each operation in the ranks' mailbox (on the engine
thread, where every post comes from) and then does its own part; every other rank does its part when it reads
the post (`apply`), and they agree on the outcome (a vote or a barrier), so rank 0 answers for all of them. A
worker of one rank is the same code with no one to tell.

Fences (shared/transfer/fence.py): rank 0 draws a reservation's fence when it opens the window and every rank
opens its pages under it; a write is checked against its fence on rank 0, around the whole write and the ranks'
vote on it, so a revocation (`revoke`, from any thread) returns only once no rank writes it any more.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from pdserve.shared.tp_shards import Shards
from pdserve.shared.tp_step import KV, START_TIMEOUT_S, TPRank, bytes_payload, read_bytes
from pdserve.shared.transfer.base import KVTransfer, TransferError, b64, unb64
from pdserve.shared.transfer.fence import WRITE_BOUND_S, Fence, SenderFences, new_fence

log = logging.getLogger(__name__)
SETTLE_S = 5.0  # beyond an operation's own timeout, for the ranks to agree on its outcome
WINDOW_S = 120.0  # closing a window waits for a write under way (TCP: at most its receive timeout)

Write = tuple[int, tuple[int, int], tuple[int, int]]  # (peer rank, local heads [lo, hi), peer heads [lo, hi))


def plan(mine: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> list[list[Write]]:
    """For each of my ranks (its KV heads of the model's, `mine[r]`), the heads it writes to each peer rank.

    Each peer rank gets every head it holds exactly once, from the first of my ranks that holds it."""
    writes: list[list[Write]] = [[] for _ in mine]
    for d, (d0, d1) in enumerate(theirs):
        done = d0
        for r, (r0, r1) in enumerate(mine):
            a, b = max(r0, done), min(r1, d1)
            if a < b:
                writes[r].append((d, (a - r0, b - r0), (a - d0, b - d0)))
                done = b
        if done < d1:
            raise TransferError(f"no rank here holds KV heads {done}..{d1 - 1} that peer rank {d} needs")
    return writes


def check_layouts(mine: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> None:
    """Whether two workers' head layouts can be mapped at all: the same model's heads, each held somewhere."""
    if not theirs or max(h for _, h in mine) != max(h for _, h in theirs):
        raise TransferError(f"the peer's ranks hold KV heads {theirs}, this worker's {mine}: not the same model's "
                            f"heads")


class RankTransfers:
    """One rank's share of the worker's KV transfer: its agent, and the writes planned for each peer."""

    def __init__(self, agent: KVTransfer, tp: TPRank | None, ranges: list[tuple[int, int]],
                 metadatas: list[bytes] | None = None) -> None:
        """`ranges`: every rank's KV heads of the model's; `metadatas`: every rank's agent metadata (rank 0)."""
        self.agent, self.tp, self.ranges = agent, tp, ranges
        self.rank = tp.shards.rank if tp is not None else 0
        self.name = agent.name
        self.num_pages = agent.num_pages
        total = max(hi for _, hi in ranges)
        self.page_bytes = agent.page_bytes // agent.kv_heads * total  # a whole page of the model's KV
        self._metadata = json.dumps({"kv_heads": total, "ranks": [
            {"kv_heads": list(rng), "agent": b64(md)} for rng, md in zip(ranges, metadatas or [])]}).encode()
        self._peers: dict[str, tuple[bytes, list[Write]]] = {}  # peer -> (its metadata, this rank's writes)
        self.fences = SenderFences()  # rank 0: the fences revoked, the writes under way

    @property
    def leads(self) -> bool:
        return self.tp is not None and self.tp.leads

    def metadata(self) -> bytes:
        return self._metadata

    def healthy(self) -> bool:
        return self.agent.healthy()

    @property
    def checks_every_write(self) -> bool:
        return self.agent.checks_every_write

    def poll(self) -> None:
        self.agent.poll()

    def close(self) -> None:
        self.agent.close()

    def has_peer(self, peer_name: str) -> bool:
        return peer_name in self._peers

    # ------------------------------------------------------------ what rank 0 asks of every rank
    def add_peer(self, peer_name: str, metadata: bytes, timeout: float = 10.0) -> None:
        old = self._peers.get(peer_name)
        if old is not None and old[0] == metadata:
            return
        self._lead("add", {"peer": peer_name, "metadata": metadata.decode()}, timeout)

    def remove_peer(self, peer_name: str) -> None:
        if peer_name in self._peers:
            self._lead("remove", {"peer": peer_name}, 0.0)

    def write_pages(self, peer_name: str, src_pages: list[int], dst_pages: list[int], timeout: float = 30.0,
                    fence: Fence | None = None) -> None:
        """Refused (TransferError) where `fence` was revoked or its lease ran out (fence.SenderFences)."""
        if peer_name not in self._peers:
            raise TransferError(f"peer {peer_name} is not registered")
        with self.fences.writing(peer_name, fence):
            self._lead("write", {"peer": peer_name, "src": list(src_pages), "dst": list(dst_pages),
                                 "fence": fence.value if fence is not None else 0, "timeout": timeout}, timeout)

    def revoke(self, peer_name: str, fence: int, wait_s: float = WRITE_BOUND_S) -> bool:
        """No write of `fence` to `peer_name` starts from now on; True once none is under way (False: one still
        was after `wait_s`). Safe from any thread: it posts nothing to the ranks."""
        return self.fences.revoke(peer_name, fence, wait_s)

    def open_window(self, pages: list[int]) -> int:
        """Open `pages` to writes under a fresh fence, which it returns (the writer must carry it)."""
        fence = new_fence()
        self._lead("open", {"pages": list(pages), "fence": fence}, 0.0)
        return fence

    def close_window(self, pages: list[int]) -> None:
        self._lead("close", {"pages": list(pages)}, WINDOW_S)

    def _lead(self, op: str, args: dict, timeout: float) -> None:
        if self.leads:
            self.tp.box.post(KV, [], bytes_payload(json.dumps({"op": op, **args}).encode()))
        self._do(op, args, timeout)

    # ------------------------------------------------------------ every rank's part
    def apply(self) -> None:
        """A follower: the operation rank 0 posted (its payload in the mailbox)."""
        args = json.loads(read_bytes(self.tp.box.payload))
        self._do(args.pop("op"), args, float(args.get("timeout", 10.0)))

    def _do(self, op: str, args: dict, timeout: float) -> None:
        error = None
        try:
            getattr(self, f"_{op}")(**{k: v for k, v in args.items() if k != "timeout"}, timeout=timeout)
        except TransferError as exc:
            error = exc
            if self.rank:
                log.error("tensor-parallel rank %d: %s", self.rank, exc)
        if self.tp is None:
            if error is not None:
                raise error
            return
        if op in ("open", "close", "remove"):  # cannot fail: the ranks only wait for each other
            self.tp.group.barrier(timeout + SETTLE_S)
            return
        failed = self.tp.group.failed_ranks(error is not None, timeout + SETTLE_S)
        if failed and op == "add" and error is None:  # all or none of the ranks know the peer
            self._remove(args["peer"])
        if error is not None:
            raise error
        if failed:
            raise TransferError(f"tensor-parallel rank(s) {failed} could not {op} KV for {args.get('peer')} "
                                "(their logs say why)")

    def _add(self, peer: str, metadata: str, timeout: float) -> None:
        try:
            md = json.loads(metadata)
            theirs = [tuple(r["kv_heads"]) for r in md["ranks"]]
            agents = [unb64(r["agent"]) for r in md["ranks"]]
        except (ValueError, TypeError, KeyError) as exc:
            raise TransferError(f"peer {peer}: unreadable transfer metadata ({exc})") from None
        check_layouts(self.ranges, theirs)
        writes = plan(self.ranges, theirs)[self.rank]
        added = []
        try:
            for d, _, _ in writes:
                self.agent.add_peer(f"{peer}#{d}", agents[d], timeout)
                added.append(d)
        except TransferError:
            for d in added:
                self.agent.remove_peer(f"{peer}#{d}")
            raise
        self._peers[peer] = (metadata.encode(), writes)

    def _remove(self, peer: str, timeout: float = 0.0) -> None:
        _, writes = self._peers.pop(peer, (b"", []))
        for d, _, _ in writes:
            self.agent.remove_peer(f"{peer}#{d}")

    def _write(self, peer: str, src: list[int], dst: list[int], fence: int, timeout: float) -> None:
        known = self._peers.get(peer)
        if known is None:
            raise TransferError(f"peer {peer} is not registered")
        for d, mine, theirs in known[1]:
            self.agent.write_heads(f"{peer}#{d}", src, dst, mine, theirs, timeout, fence)

    def _open(self, pages: list[int], fence: int, timeout: float) -> None:
        self.agent.open_window(pages, fence)

    def _close(self, pages: list[int], timeout: float) -> None:
        self.agent.close_window(pages)


@dataclass(frozen=True)
class TransferSpec:
    """How each rank of a disaggregated worker makes its KV transfer agent."""

    backend: str  # "nixl" | "tcp"
    name: str  # the worker's; rank r's agent is "{name}#r{r}"
    receiver_host: str | None = None  # a decode worker's TCP agents listen on port + rank
    receiver_port: int = 0


def rank_transfers(spec: TransferSpec, rank: TPRank | None, runner):
    """This rank's agent over its pool, and (every rank together) the worker's transfer across its ranks."""
    from pdserve.shared.transfer import create_transfer  # (imports a backend's package only when chosen)

    r = rank.shards.rank if rank is not None else 0
    kwargs = {}
    if spec.backend == "tcp" and spec.receiver_host is not None:
        kwargs = {"host": spec.receiver_host, "port": spec.receiver_port + r if spec.receiver_port else 0}
    agent = create_transfer(spec.backend, spec.name if rank is None else f"{spec.name}#r{r}", runner.pool.buffer,
                            **kwargs)
    mc, size = runner.model_config, rank.shards.size if rank is not None else 1
    ranges = [Shards.plan(mc, i, size).kv_heads if size > 1 else (0, mc.num_kv_heads) for i in range(size)]
    metadatas = rank.group.all_gather_bytes(agent.metadata(), START_TIMEOUT_S) if rank is not None else \
        [agent.metadata()]
    return RankTransfers(agent, rank, ranges, metadatas)
