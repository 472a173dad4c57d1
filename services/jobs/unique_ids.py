"""Whether each custom_id of a batch input file is new, checked in Redis so that a process holds at most one
chunk of ids, however many requests the file has.

One validation run owns one hash, `batch:{id}:ids:{run}`: custom_id -> the line that first used it. `flush`
registers a chunk of (line, custom_id) pairs in one script (scripts.CHECK_IDS, in line order, so a duplicate
within the chunk is found too), which answers with the first line of each id seen before. The run's own key
(a fresh `run` each time) means a re-run after a crash never sees ids of the run before it; the key is deleted
at the end and expires if its run dies first. Ids up to SHORT_ID bytes are stored as they are; a longer one
as a 128-bit digest, so Redis holds at most ~100 bytes per request.
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from pdserve.services.jobs import scripts
from pdserve.services.jobs.store import Store

CHUNK = 1000  # ids per round trip
SHORT_ID = 64  # bytes: a longer custom_id is stored as its digest
TTL_S = 3600  # a run that died leaves its key this long at most (renewed at every chunk)


@dataclass(frozen=True)
class Duplicate:
    line: int
    custom_id: str
    first_line: int


def field(custom_id: str) -> bytes:
    raw = custom_id.encode("utf-8")
    return b"=" + raw if len(raw) <= SHORT_ID else b"#" + hashlib.blake2b(raw, digest_size=16).digest()


class UniqueIds:
    """Lifecycle: add()... (a chunk is checked whenever CHUNK are pending) -> flush() -> close()."""

    def __init__(self, store: Store, batch_id: str) -> None:
        self.store = store
        self.key = store.k.ids(batch_id, secrets.token_hex(4))
        self.pending: list[tuple[int, str]] = []
        self._check = store.r.register_script(scripts.CHECK_IDS)

    def add(self, line: int, custom_id: str) -> bool:
        """Queue one id; whether a chunk is full (then `flush`)."""
        self.pending.append((line, custom_id))
        return len(self.pending) >= CHUNK

    async def flush(self) -> list[Duplicate]:
        """Check the pending ids: those seen before (earlier in this chunk or in an earlier one)."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        args: list[bytes | int] = [TTL_S]
        for line, custom_id in pending:
            args += [field(custom_id), line]
        taken = await self._check(keys=[self.key], args=args)
        return [Duplicate(*pending[int(n) - 1], int(first)) for n, first in zip(taken[0::2], taken[1::2])]

    async def close(self) -> None:
        self.pending = []
        await self.store.r.delete(self.key)
