"""The decode role: reserve pages for a prompt, let a prefill worker fill them, then decode.

A prompt whose prefix this worker's cache holds but for a few tokens (a conversation's next turn) is computed
here instead, as a colocated worker computes it (`prefills_here`); so is a choice resumed from another worker
(migration, shared/resume.py), whose output so far no prefill worker holds.

Lifecycle of one request: `queue` -> WAITING_FOR_PAGES (`reserving`) -> pages reserved, `on_pages_reserved`
tells the worker service to call prefill -> WAITING_FOR_KV (`awaiting_kv`) -> `kv_ready` (the prefill call
answered with the first tokens) -> RUNNING in the scheduler's batch -> FINISHED. A request retracted when
pages run out waits in the scheduler's queue and is recomputed here, prompt and output so far.

Pages of a request removed while its KV was on its way stay in `quarantine`: the prefill worker may still be
writing into them, so they go back to the pool only at `kv_settled` (the reservation's fence is settled: no
write of it can land any more, shared/transfer/fence.py), never to another request before. The role is a
`PageHolder` of the scheduler: its requests count as live, its pages as held.

Live moves (move_out.py): a generation frozen here waits, with its pages, for the decode worker that continues
it; one moved in (`Req.moved_in`) reserves pages for its prompt and output so far, which that worker fills.
"""
from __future__ import annotations

import time

from typing import Callable

from pdserve.shared.config import Role
from pdserve.shared.outputs import FirstToken
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.roles.engine_role import EngineRole
from pdserve.shared.roles.move_out import MoveOut
from pdserve.shared.scheduler import Batch
from pdserve.shared.step_ops import StepOps


class DecodeRole(EngineRole):
    kind = Role.DECODE

    def __init__(self, ops: StepOps, poll_fn: Callable[[], None] | None) -> None:
        super().__init__(ops)
        self.poll_fn = poll_fn
        self.reserving: list[Req] = []
        self.awaiting_kv: dict[str, list[Req]] = {}  # by rid
        self.quarantine: dict[str, list[int]] = {}
        self.moves = MoveOut(ops)
        self.scheduler.holders.append(self)

    @property
    def idle_wait_s(self) -> float:  # KV arrives by polling the transfer: look often while some is due
        return 0.002 if self.awaiting_kv else 0.05

    def queue(self, req: Req) -> None:
        if not req.moved_in and (req.resumed is not None or self.prefills_here(req)):
            self.scheduler.add(req)  # computed here after its cached prefix, as a retracted request is
            return
        req.status = ReqStatus.WAITING_FOR_PAGES
        self.reserving.append(req)
        self.reserve()

    def prefills_here(self, req: Req) -> bool:
        """The cache holds the prompt but for a few tokens (SchedulerConfig.local_prefill_max_tokens), and a page's
        worth of it at least: a short prompt that shares a few leading tokens with the cache goes to prefill."""
        s = self.scheduler
        limit = s.config.local_prefill_max_tokens
        if limit <= 0 or len(req.input_ids) <= s.page_size:
            return False
        match = s.cache.match_prefix(req.input_ids, namespace=req.cache_namespace, max_tokens=len(req.input_ids) - 1)
        cached = len(match.pages) * s.page_size + match.tail_tokens
        return cached >= s.page_size and len(req.input_ids) - cached <= limit

    def before_step(self) -> None:
        self.moves.expire()
        self.reserve()

    def sampled(self, reqs, tokens, logprobs, compute_s: float):
        decoding = super().sampled(reqs, tokens, logprobs, compute_s)
        return self.moves.take(decoding) if self.moves.asked else decoding

    def schedule(self) -> Batch | None:
        # The scheduler's waiting queue holds the requests computed here: retracted when pages ran out (prompt
        # and output so far), and prompts whose prefix this worker's cache holds (`prefills_here`).
        return self.scheduler.schedule_mixed()

    def has_work(self) -> bool:
        return bool(self.reserving)

    def num_queued(self) -> int:
        return len(self.reserving) + len(self.moves.frozen)

    def holds_nothing(self) -> bool:
        return not (self.reserving or self.awaiting_kv or self.quarantine or self.moves.frozen)

    def poll(self) -> None:
        if self.poll_fn is not None:
            self.poll_fn()

    def reserve(self) -> None:
        """Reserve prompt pages for waiting requests, oldest first, and start their prefill."""
        s = self.scheduler
        while self.reserving and s.num_running + len(self.awaiting_kv) < s.config.max_running_requests:
            req = self.reserving[0]
            if not s.can_hold_adapter(req):
                break
            pages = s.allocate(-(-req.seq_len // s.page_size))  # a move's output so far too
            if pages is None:
                break
            self.reserving.pop(0)
            s.hold_adapter(req)
            req.pages = pages
            req.status = ReqStatus.WAITING_FOR_KV
            req.pages_reserved = time.monotonic()
            self.awaiting_kv.setdefault(req.rid, []).append(req)
            if req.on_pages_reserved is not None:
                req.on_pages_reserved(req)

    def kv_ready(self, rid: str, first_tokens: list[FirstToken], cached_tokens: int) -> None:
        """Prefill filled the reserved pages of `rid`; start decoding it."""
        group = self.awaiting_kv.pop(rid, None)
        if not group:
            return  # aborted meanwhile
        req = group[0]
        req.num_computed = req.seq_len
        req.cached_tokens = cached_tokens
        self.scheduler.cache_pages(req, lock=True)
        children = [req] + self.fork(req)
        self.ops.commit([(child, first.token_id, first.logprob) for child, first in zip(children, first_tokens)])

    def kv_settled(self, rid: str) -> None:
        """No KV write into `rid`'s reserved pages can land any more (their fence is settled): the pages of an
        `rid` aborted while it waited for them go back to the pool now. The settle is the reservation's last
        word (its call ended unanswered, or `kv_ready` came first): a request still waiting for that KV would wait
        for good, holding its pages, so it is dropped and its pages go too (a quarantine filled after the settle
        would never be freed)."""
        if rid in self.awaiting_kv:
            self.ops.abort(rid, error="its prompt's KV will not come: the prefill call ended unanswered")
        self.scheduler.allocator.free(self.quarantine.pop(rid, []))

    # ------------------------------------------------------------ PageHolder
    def held_reqs(self) -> list[Req]:
        return self.reserving + [r for group in self.awaiting_kv.values() for r in group] + self.moves.held_reqs()

    def held_pages(self) -> dict[str, list[int]]:
        return self.quarantine

    def discard(self, req: Req) -> None:
        if self.moves.discard(req):
            return
        if req in self.reserving:
            self.reserving.remove(req)
        group = self.awaiting_kv.get(req.rid)
        if group and req in group:
            group.remove(req)
            if not group:
                del self.awaiting_kv[req.rid]
            self.quarantine.setdefault(req.rid, []).extend(req.pages[req.num_cached_pages:])
            req.pages = req.pages[:req.num_cached_pages]
