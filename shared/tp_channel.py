"""The leader's posts to ranks on other machines: `StoreBox`, the mailbox of shared/tp_group.py carried by
torch.distributed's TCPStore, with the same calls (`post`, `fetch`, `payload`), so the step protocol
(shared/tp_step.py) and a follower's loop (shared/tp_ranks.py `follow`) are the same on one machine or several.

Post n is the store key "post/n": the kind, the header and the payload as int64s. A follower waits on the next
key for as long as the worker is idle (no collective timeout runs meanwhile) and reads it; the tensors of a step
go through the process group (`TorchGroup.broadcast`). Rank 0 deletes post n - 2 when it makes post n: every post
is followed by a collective that needs every rank, so by then each has read it. The store lives in rank 0's
process: a follower whose wait fails on a closed connection knows rank 0 is gone.

With a cluster token a post starts with its tag (shared/tp_nodes.py `tag`: HMAC-SHA256 of the key and the post),
and a follower checks it before it uses the post: a post that fails, written by a process without the token, is
RankGone, and the worker goes down rather than compute a step rank 0 did not ask for.
"""
from __future__ import annotations

import datetime
import hmac
import time

import numpy as np
import torch
import torch.distributed as dist

from pdserve.shared.cluster_auth import TOKEN_ENV, cluster_token
from pdserve.shared.tp_group import RankGone
from pdserve.shared.tp_nodes import TAG_BYTES, tag

HEADER_INTS = 32
_IDLE_WAIT_S = 0.02  # between an idle follower's calls to `idle()` (its KV agent's progress)
_LONG_WAIT_S = 30.0  # between checks of the deadline when there is nothing to call


class StoreBox:
    """Rank 0 posts, the other ranks fetch, in order; `payload` is the last post's payload (int64)."""

    def __init__(self, store, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.seen = 0  # the posts made (leader) or read (follower)
        self.payload = torch.zeros(0, dtype=torch.int64)
        self.token = cluster_token()  # every rank of a worker has the same environment

    def post(self, kind: int, header: list[int], payload: torch.Tensor | None = None) -> None:
        if len(header) > HEADER_INTS:
            raise ValueError(f"a tensor-parallel step header holds {HEADER_INTS} integers, got {len(header)}")
        raw = np.array([kind, len(header), *header], dtype=np.int64).tobytes()
        if payload is not None:
            raw += payload.reshape(-1).to(torch.int64).numpy().tobytes()
        self.seen += 1
        key = f"post/{self.seen}"
        try:
            self.store.set(key, raw if self.token is None else tag(self.token, key, raw) + raw)
            if self.seen > 2:
                self.store.delete_key(f"post/{self.seen - 2}")
        except dist.DistError as exc:  # (the store is this process's: only a broken machine gets here)
            raise RankGone(f"tensor-parallel rank 0 cannot post to the other ranks: {exc}") from None

    def fetch(self, timeout_s: float | None, idle=None) -> tuple[int, list[int]]:
        """Follower: (kind, header) of the leader's next post. timeout_s None: as long as rank 0 is there."""
        key = f"post/{self.seen + 1}"
        start = time.monotonic()
        while True:
            wait_s = _IDLE_WAIT_S if idle is not None else _LONG_WAIT_S
            if timeout_s is not None:
                wait_s = max(0.001, min(wait_s, timeout_s - (time.monotonic() - start)))
            try:
                self.store.wait([key], datetime.timedelta(seconds=wait_s))
                raw = self.store.get(key)
                break
            except dist.DistNetworkError as exc:
                raise RankGone(f"tensor-parallel rank {self.rank}: rank 0 is gone (its store closed: {exc})") \
                    from None
            except dist.DistStoreError:  # the wait's time is up
                if timeout_s is not None and time.monotonic() - start >= timeout_s:
                    raise RankGone(f"tensor-parallel rank {self.rank}: no word from rank 0 for {timeout_s:g} s "
                                   "while waiting for the next step") from None
                if idle is not None:
                    idle()
        self.seen += 1
        body = self._checked(key, raw)
        ints = np.frombuffer(body, dtype=np.int64, count=len(body) // 8)
        if len(body) % 8 or len(ints) < 2 or not 0 <= ints[1] <= min(HEADER_INTS, len(ints) - 2):
            raise RankGone(f"tensor-parallel rank {self.rank}: store key {key!r} holds no post ({len(body)} bytes)")
        kind, n = int(ints[0]), int(ints[1])
        self.payload = torch.from_numpy(ints[2 + n:].copy())
        return kind, ints[2:2 + n].tolist()

    def _checked(self, key: str, raw: bytes) -> bytes:
        """The post under its tag, once the tag proves rank 0 wrote it (without a token: as it is)."""
        if self.token is None:
            return raw
        if not hmac.compare_digest(raw[:TAG_BYTES], tag(self.token, key, raw[TAG_BYTES:])):
            raise RankGone(f"tensor-parallel rank {self.rank}: a post to the tensor-parallel ranks failed its check: "
                           f"written by a process without the cluster token? (store key {key!r}; every node of a "
                           f"worker needs the same {TOKEN_ENV})")
        return raw[TAG_BYTES:]
