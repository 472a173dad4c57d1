"""Fences: no KV write of a reservation lands once its pages may belong to another request.

A receiving worker (decode, or a decode worker taking a migrated request) reserves pages and hands them to a
writer under a *fence*: a generation number drawn afresh for that reservation (`new_fence`), which every write
into those pages carries. The pages go back to the pool, for another request, only once the fence is *settled*:
no write carrying it can land any more. Three things settle a fence, whichever comes first:
- the writer answered the call that named the pages (it answers after its last write completed);
- the writer acknowledged the fence's revocation (`SenderFences.revoke`): from then on it refuses every write
  carrying it, and a write of it already under way has ended;
- the fence's lease ran out (`Lease`): the writer starts no write of it after a deadline in its own clock, and a
  write it started ends within WRITE_BOUND_S (its timeout; past that the connection to the peer is torn down),
  so once the receiver knows the writer's clock passed deadline + WRITE_BOUND_S, nothing of it can land.
Until then the pages stay quarantined: held, but no request's.

Why the sender checks: NIXL WRITEs and CUDA IPC copies are one-sided, the receiver's CPU never sees them land,
so nothing on the receiving side can refuse a late one. The sender, a member of the cluster proven at
registration, checks the fence right before each write (`SenderFences.writing`). Where the receiver does see
each write (the TCP socket), it checks too (`PageFences`): a write lands only in pages whose current fence it
carries, so a write of an old reservation is refused even in pages reserved again since.

The lease needs no synchronised clocks: each registration is a round trip in which the writer tells its
monotonic clock (`PeerClock`); the receiver converts a duration into a deadline in the writer's clock and,
back, the moment its own clock has surely passed it. Clocks on two hosts advance at the same rate, which is
all this relies on.
"""
from __future__ import annotations

import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.shared.transfer.errors import TransferError

WRITE_BOUND_S = 40.0  # the longest a write may take once started: its timeout (30 s), the ranks' vote (5 s), a margin
CLOSED = -1  # a page no write may land in
REVOKED_MEMORY_S = 900.0  # how long a revoked fence is remembered: longer than any lease


def new_fence() -> int:
    """A fresh fence: random, so that two reservations (even across restarts of the receiver) never share one."""
    return secrets.randbits(62) + 1


class PageFences:
    """The receiving side's table: the fence each page's current reservation carries (CLOSED: none)."""

    def __init__(self, num_pages: int) -> None:
        self.current = [CLOSED] * num_pages
        self.busy = [0] * num_pages  # messages being written into each page now (two ranks' heads at once)
        self.cond = threading.Condition()

    def open(self, pages: list[int], fence: int) -> None:
        with self.cond:
            for p in pages:
                self.current[p] = fence

    def close(self, pages: list[int], wait_s: float) -> None:
        """No write lands in `pages` from now on; waits (at most `wait_s`) for one already being written."""
        with self.cond:
            for p in pages:
                self.current[p] = CLOSED
            self.cond.wait_for(lambda: not any(self.busy[p] for p in pages), wait_s)

    def claim(self, runs: list[tuple[int, int]], fence: int) -> str:
        """Mark the pages of a message busy, or say why it may not write them."""
        with self.cond:
            for dst, pages in runs:
                for p in range(dst, dst + pages):
                    if self.current[p] == CLOSED:
                        return (f"destination pages {dst}..{dst + pages - 1} are not reserved for a transfer now "
                                "(the request was aborted, or they were never asked for)")
                    if self.current[p] != fence:
                        return (f"destination page {p} is reserved under another fence now: this write belongs "
                                "to an earlier reservation (aborted) and is refused")
            for dst, pages in runs:
                for p in range(dst, dst + pages):
                    self.busy[p] += 1
        return ""

    def unclaim(self, runs: list[tuple[int, int]]) -> None:
        with self.cond:
            for dst, pages in runs:
                for p in range(dst, dst + pages):
                    self.busy[p] -= 1
            self.cond.notify_all()


@dataclass(frozen=True)
class Fence:
    """What a write carries: the reservation's fence, and the deadline (the sender's monotonic clock) after which
    no write of it may start."""

    value: int
    deadline: float = float("inf")


class SenderFences:
    """The writing side: fences revoked per peer, and the writes under way per fence."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._revoked: dict[tuple[str, int], float] = {}  # (peer, fence) -> when; oldest first
        self._writing: dict[tuple[str, int], int] = {}

    @contextmanager
    def writing(self, peer: str, fence: Fence | None):
        """Around one write: refused (TransferError) if its fence was revoked or its lease ran out."""
        if fence is None:
            yield
            return
        key = (peer, fence.value)
        with self._cond:
            if key in self._revoked:
                raise TransferError(f"the reservation of these pages at {peer} was revoked (the request was "
                                    "aborted): nothing written")
            if time.monotonic() > fence.deadline:
                raise TransferError(f"the reservation of these pages at {peer} ran out of time: nothing written")
            self._writing[key] = self._writing.get(key, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._writing[key] -= 1
                if not self._writing[key]:
                    del self._writing[key]
                self._cond.notify_all()

    def revoke(self, peer: str, fence: int, wait_s: float = WRITE_BOUND_S) -> bool:
        """No write of `fence` to `peer` starts from now on; returns once none is under way (True), or False if
        one still is after `wait_s` (the caller tears the connection down)."""
        key = (peer, fence)
        now = time.monotonic()
        with self._cond:
            self._revoked[key] = now
            while self._revoked:
                oldest, at = next(iter(self._revoked.items()))
                if now - at < REVOKED_MEMORY_S:
                    break
                del self._revoked[oldest]
            return self._cond.wait_for(lambda: key not in self._writing, wait_s)


@dataclass(frozen=True)
class PeerClock:
    """One registration round trip: our monotonic clock when we sent it and when its answer came, the writer's
    when it answered."""

    sent: float
    theirs: float
    answered: float

    def deadline(self, now: float, lease_s: float) -> float:
        """A deadline in the writer's clock at least `lease_s` after its clock reads now (it read at most
        `theirs + (now - sent)`)."""
        return self.theirs + (now - self.sent) + lease_s

    def passed_at(self, deadline: float) -> float:
        """When our clock is sure the writer's passed `deadline` (it read at least `theirs` at `answered`)."""
        return self.answered + (deadline - self.theirs)


class Lease:
    """A reservation's lease, stamped before each send of the call that names its pages."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.settled_by = 0.0  # our clock: no write of the fence can land after it

    def stamp(self, clock: PeerClock) -> float:
        """The deadline to send (the writer's clock); every send counts, the latest bounds them all."""
        deadline = clock.deadline(time.monotonic(), self.lease_s)
        self.settled_by = max(self.settled_by, clock.passed_at(deadline + WRITE_BOUND_S))
        return deadline
