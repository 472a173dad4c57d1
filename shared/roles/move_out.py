"""Live move, the source side: a decode worker's generations frozen at a step boundary, their KV kept for the
decode worker that continues them, then handed over once.

    freeze(rids)   marks them; a mark lasts LEASE_S
    take(...)      at a marked generation's next decode step (its KV now holds prompt and every output), its
                   sampled token is held back and it leaves the running batch with its pages; what it had not sent
                   leaves, then the error MOVED + reason ends its stream
    frozen_for(...) the destination's call finds it (its every token must be the caller's), writes its pages
                   into the destination's reservation, and `release` frees them here; the held token is the
                   destination's first
    expire()       one nobody took within LEASE_S (or an abort, through `discard`) is dropped, its pages freed

Only a step read at once freezes (an overlapped step's placeholder means the last token's KV is not there yet);
n > 1 is refused at `freeze` (each choice has its own pages and state, which one held token cannot carry): asked
to rebalance, it goes on here; asked because the worker drains, it ends at once with an error, which the gateway
continues by recomputation (every choice resumed) rather than let the drain wait it out.
Frozen generations belong to the decode role: their pages count as held (scheduler.PageHolder).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.shared.outputs import MOVED, ReqOutput, TokenLogprobs
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.scheduler import Scheduler
from pdserve.shared.step_ops import Sampled, StepOps

LEASE_S = 15.0  # a mark, or a frozen generation, nobody acted on within this long is dropped


@dataclass
class Frozen:
    req: Req
    token: int  # sampled at the step that froze it, held back: the destination's first output
    logprob: TokenLogprobs | None
    until: float  # monotonic: dropped after


class MoveOut:
    def __init__(self, ops: StepOps) -> None:
        self.ops = ops
        self.scheduler: Scheduler = ops.scheduler
        self.asked: dict[str, tuple[str, float]] = {}  # rid -> (reason, until)
        self.frozen: dict[str, Frozen] = {}

    def freeze(self, reqs: list[Req], reason: str) -> tuple[list[str], list[str]]:
        """Mark `reqs` to freeze at their next decode step; (rids marked, "<rid>: <why>" refused)."""
        marked, refused = [], []
        until = time.monotonic() + LEASE_S
        for req in reqs:
            if req.rid in self.frozen or req.rid in self.asked or any(r.startswith(f"{req.rid}: ") for r in refused):
                continue  # n > 1: one entry for all its choices
            if req.params.n > 1:
                refused.append(f"{req.rid}: n > 1 (its choices move by recomputation)")
                if reason == "drain":
                    self.ops.abort(req.rid, error="this decode worker is shutting down: n > 1 choices move by "
                                                  "recomputation")
                continue
            self.asked[req.rid] = (reason, until)
            marked.append(req.rid)
        return marked, refused

    def take(self, decoding: Sampled) -> Sampled:
        """Of a step's sampled tokens, hold back those of marked generations, freezing them; the rest go on."""
        kept: Sampled = []
        for req, token, logprob in decoding:
            mark = self.asked.get(req.rid)
            if mark is None or req.status != ReqStatus.RUNNING or any(t < 0 for t in req.output_ids[-2:]):
                kept.append((req, token, logprob))
                continue
            del self.asked[req.rid]
            self.scheduler.running.remove(req)
            self.frozen[req.rid] = Frozen(req, token, logprob, time.monotonic() + LEASE_S)
            self.ops.emit(req)  # the tokens it had not sent: the destination continues after them
            if req.on_output is not None:
                req.on_output(ReqOutput(req.rid, req.index, [], [], error=MOVED + mark[0]))
        return kept

    def frozen_for(self, rid: str, token_ids: list[int]) -> Frozen:
        """The frozen generation `rid`, which the caller continues from `token_ids`; LookupError where none is
        frozen here, ValueError where the caller holds other tokens."""
        frozen = self.frozen.get(rid)
        if frozen is None:
            raise LookupError(f"no generation {rid} is frozen here (it ended, was dropped after {LEASE_S:g} s, "
                              "or was already taken)")
        have = frozen.req.fill_ids
        if have != token_ids:
            raise ValueError(f"generation {rid} froze here at {len(have)} tokens, the caller continues it from "
                             f"{len(token_ids)} tokens that differ")
        return frozen

    def release(self, rid: str) -> None:
        """Its KV went (or will never go): free its pages; they stay cached as any finished generation's."""
        frozen = self.frozen.pop(rid, None)
        if frozen is not None:
            self.scheduler.release(frozen.req, cache=True)
            frozen.req.status = ReqStatus.FINISHED

    def expire(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, (_, until) in self.asked.items() if until < now]:
            del self.asked[rid]
        for rid in [rid for rid, f in self.frozen.items() if f.until < now]:
            self.release(rid)

    # ------------------------------------------------------------ as part of the decode role's PageHolder
    def held_reqs(self) -> list[Req]:
        return [f.req for f in self.frozen.values()]

    def discard(self, req: Req) -> bool:
        """An abort or revocation removes a frozen `req` (the scheduler frees its pages next); whether it was."""
        self.asked.pop(req.rid, None)
        frozen = self.frozen.get(req.rid)
        if frozen is None or frozen.req is not req:
            return False
        del self.frozen[req.rid]
        return True
