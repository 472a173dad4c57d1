"""The storage tier across a tensor-parallel worker's ranks: every rank stores and reads its own KV heads of each
page, under a key of its own, and a page counts as stored only when every rank's part is.

Rank 0 decides what is written and read (kv_tiers.py, as in a worker of one rank) and writes and reads its own
part; `TierRanks` posts each decision in the ranks' mailbox (tp_step.TIER, on the engine thread that posts every
step), and each other rank's `RankStore` does its part when it reads the post (tp_ranks.follow):
- write: it copies its heads of the pool's pages at once, before any later step can reuse those pages (so rank 0's
  lock on them need not wait for it), and writes the copies on a thread of its own. At most a quarter of its pool
  waits there, as on rank 0: a rank that far behind makes rank 0 wait for it (its writes are as large as rank
  0's, so it is seldom behind), and one still behind after WRITE_WAIT_S drops the job: its part is then missing;
- read: it reads its parts of the pages rank 0 read back, and the ranks agree on how many leading pages every one
  of them has: only those go into the pool (a part missing, damaged or dropped on any rank is a miss for all);
- put: it copies what it read into the pool pages rank 0 chose for them;
- flush: its stored pages become unreachable, as rank 0's.
Each post is followed by a collective of every rank (a barrier, or the read's count), as every post must be.

Rank r's key for a page is chained from its own identity (kv_keys.kv_identity: the TP size, its rank and its KV
heads, with the weights and kernels) over rank 0's key for the page, which names the page's whole prefix and rank
0's identity (so a weight update, which moves rank 0's, moves every rank's keys). The followers read on rank 0's
engine thread's time (rank 0 waits for their count): a load costs the slowest rank's read of its part, once, when
rank 0's own read is done. The host tier is rank 0's alone, so a tensor-parallel worker has storage only
(model_runner.py refuses the host tier's flags there).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from typing import TYPE_CHECKING

import torch

from pdserve.shared.kv_files import KVFiles
from pdserve.shared.kv_keys import chain_keys, identity_key
from pdserve.shared.kv_tier_writer import WRITE_RUN
from pdserve.shared.tp_step import TIER, TPRank, bytes_payload, read_bytes

if TYPE_CHECKING:
    from pdserve.shared.config import TierConfig
    from pdserve.shared.kv_pool import KVPool

log = logging.getLogger(__name__)
TIMEOUT_S = 120.0  # for every rank to take its part of one operation (a read of a long prompt's pages included)
WRITE_WAIT_S = 30.0  # a rank's writer this long behind drops a job rather than hold rank 0 any longer


class TierRanks:
    """Rank 0's side: what it asks every other rank to do with its part of the pages."""

    def __init__(self, tp: TPRank) -> None:
        self.tp = tp

    def write(self, keys: list[str], pages: list[int]) -> None:
        """Pool pages `pages` are to be stored under rank 0's `keys` (called before they can be reused)."""
        self._post("write", keys=keys, pages=pages)
        self.tp.group.barrier(TIMEOUT_S)

    def read(self, keys: list[str]) -> int:
        """How many leading pages of `keys` (which rank 0 has read) every other rank has read its part of."""
        self._post("read", keys=keys)
        counts = self.tp.group.all_gather_bytes(str(len(keys)).encode(), TIMEOUT_S)
        return min(int(c) for c in counts)

    def put(self, first: int, pages: list[int]) -> None:
        """The pages read from `first` on go into pool pages `pages`."""
        self._post("put", first=first, pages=pages)
        self.tp.group.barrier(TIMEOUT_S)

    def flush(self) -> None:
        self._post("flush")
        self.tp.group.barrier(TIMEOUT_S)

    def _post(self, op: str, **args) -> None:
        self.tp.box.post(TIER, [], bytes_payload(json.dumps({"op": op, **args}).encode()))


class RankStore:
    """A follower's part of the storage tier: its own files, its writer thread, what it read last."""

    def __init__(self, tp: TPRank, config: TierConfig, pool: KVPool, identity: dict, model_path: str) -> None:
        self.tp, self.pool = tp, pool
        self.files = KVFiles.for_tier(config, pool.layout.page_bytes)
        self.root_key = identity_key(identity)
        self.files.use(self.root_key, identity, model_path)
        self.limit_pages = max(1, pool.num_pages // 4)
        self.dropped = 0  # pages not written: `limit_pages` still waited after WRITE_WAIT_S
        self._pending = 0  # pages queued and not yet written (under `_room`)
        self._room = threading.Condition()
        self._jobs: queue.Queue[tuple[list[str], torch.Tensor]] = queue.Queue()
        self._read: list[bytes] = []
        threading.Thread(target=self._write_loop, name="kv-tier-rank-write", daemon=True).start()

    def apply(self) -> None:
        """The operation rank 0 posted (its payload in the mailbox)."""
        args = json.loads(read_bytes(self.tp.box.payload))
        op = args.pop("op")
        if op == "read":
            got = self._read_parts(self._keys(args["keys"]))
            self.tp.group.all_gather_bytes(str(got).encode(), TIMEOUT_S)
            return
        if op == "write":
            self._write(self._keys(args["keys"]), args["pages"])
        elif op == "put":
            self._put(args["first"], args["pages"])
        elif op == "flush":
            self.files.flush()
            self._read = []
        self.tp.group.barrier(TIMEOUT_S)

    def _keys(self, keys: list[str]) -> list[str]:
        """This rank's keys for rank 0's."""
        return [chain_keys(self.root_key, [(key,)])[0] for key in keys]

    def _write(self, keys: list[str], pages: list[int]) -> None:
        with self._room:
            if not self._room.wait_for(lambda: not self._pending or self._pending + len(keys) <= self.limit_pages,
                                       WRITE_WAIT_S):
                self.dropped += len(keys)
                log.warning("tensor-parallel rank %d: %d KV pages not stored (its writer is %d pages behind)",
                            self.tp.shards.rank, len(keys), self._pending)
                return
            self._pending += len(keys)
        index = torch.tensor(pages, device=self.pool.buffer.device)
        self._jobs.put((keys, self.pool.buffer[index].to("cpu")))  # a copy: the pages may be reused next step

    def _write_loop(self) -> None:
        while True:
            keys, copies = self._jobs.get()
            for start in range(0, len(keys), WRITE_RUN):
                run = copies[start:start + WRITE_RUN]
                self.files.write_run(keys[start:start + WRITE_RUN],
                                     [page.reshape(-1).view(torch.uint8).numpy().data for page in run])
            with self._room:
                self._pending -= len(keys)
                self._room.notify_all()

    def _read_parts(self, keys: list[str]) -> int:
        self._read = self.files.read_run(keys)  # up to the first part missing or damaged
        return len(self._read)

    def _put(self, first: int, pages: list[int]) -> None:
        layout, buffer = self.pool.layout, self.pool.buffer
        staged = torch.frombuffer(bytearray(b"".join(self._read[first:first + len(pages)])), dtype=torch.uint8)
        staged = staged.view(layout.dtype).view(len(pages), *buffer.shape[1:])
        buffer[torch.tensor(pages, device=buffer.device)] = staged.to(buffer.device)
        self._read = []
