"""The prefill role: compute a prompt's KV, sample each choice's first token, write the KV to a decode worker.

Lifecycle of one request: `add` (a Prefill call from a decode worker; the Future is the call's answer)
-> WAITING -> PREFILLING (chunks) -> TRANSFERRING (`transfer_fn` writes the pages, on the engine thread)
-> FINISHED, the Future resolved with a PrefillResult; its pages stay in the radix cache for later prefixes.
An abort can overtake its request (decode sends both, on two calls): the request is then refused on arrival
instead of being computed for nobody.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable

from pdserve.shared.config import Role
from pdserve.shared.outputs import FirstToken, PrefillResult, TokenLogprobs
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.roles.engine_role import EngineRole
from pdserve.shared.sampler import make_generator
from pdserve.shared.scheduler import Batch
from pdserve.shared.step_ops import Sampled, StepOps

log = logging.getLogger(__name__)

EARLY_ABORT_MEMORY_S = 60.0  # how long an abort of a request not seen yet is remembered
EARLY_ABORT_MEMORY_MAX = 10_000

# Writes the KV pages of a finished prompt to req.transfer; returns the seconds taken, raises on failure.
TransferFn = Callable[[Req], float]
# The engine's add_request(req, lora, lora_version): validates the request and hands it to `admit`.
AddFn = Callable[[Req, str | None, str | None], None]


class PrefillRole(EngineRole):
    kind = Role.PREFILL

    def __init__(self, ops: StepOps, add_request: AddFn, transfer_fn: TransferFn | None) -> None:
        super().__init__(ops)
        self.add_request = add_request
        self.transfer_fn = transfer_fn
        self._waiters: dict[str, tuple[Future, float]] = {}  # rid -> (future of its PrefillResult, arrival)
        self._early_aborts: dict[str, float] = {}  # rid -> when its abort came before it

    def add(self, req: Req, lora: str | None = None, lora_version: str | None = None) -> Future:
        """Queue `req` (with req.transfer set); the Future yields its PrefillResult."""
        if self._early_aborts.pop(req.rid, None) is not None:
            raise RuntimeError(f"request {req.rid} was aborted before it arrived")
        fut: Future = Future()
        self._waiters[req.rid] = (fut, time.monotonic())
        try:
            self.add_request(req, lora, lora_version)
        except Exception:
            self._waiters.pop(req.rid, None)
            raise
        return fut

    def admit(self, req: Req) -> None:
        self.queue(req)

    def holds_nothing(self) -> bool:
        return not (self._waiters or self.has_work())  # even with max_new_tokens 0, decode needs the prompt's KV

    def schedule(self) -> Batch | None:
        return self.scheduler.schedule_prefill()

    def family(self, req: Req) -> list[Req]:
        """Sampling-only stand-ins for the other choices: the decode worker forks the pages."""
        family = [req]
        for index in range(1, req.params.n):
            seed = None if req.params.seed is None else req.params.seed + index
            sibling = Req(rid=req.rid, input_ids=req.input_ids, params=req.params, index=index)
            sibling.generator = make_generator(seed)
            sibling.grammar = req.grammar.fork() if req.grammar is not None else None
            family.append(sibling)
        return family

    def sampled(self, reqs: list[Req], tokens: list[int], logprobs: list[TokenLogprobs | None],
                compute_s: float) -> Sampled:
        firsts: dict[str, list[FirstToken]] = {}
        for req, tok, lp in zip(reqs, tokens, logprobs):
            firsts.setdefault(req.rid, []).append(FirstToken(tok, lp))
        for req in reqs:
            if req.index == 0:
                self._transfer(req, firsts[req.rid], compute_s)
        return []  # nothing decodes here

    def _transfer(self, req: Req, firsts: list[FirstToken], compute_s: float) -> None:
        fut, arrival = self._waiters.pop(req.rid, (None, req.arrival))
        req.status = ReqStatus.TRANSFERRING
        try:
            transfer_s = self.transfer_fn(req) if self.transfer_fn is not None else 0.0
        except Exception as exc:
            log.warning("KV transfer of %s failed: %s", req.rid, exc)
            self.scheduler.remove(req, cache=True)
            if fut is not None and not fut.done():
                fut.set_exception(exc)
            return
        self.scheduler.remove(req, cache=True)
        result = PrefillResult(firsts, req.cached_tokens,
                               queue_s=max(0.0, time.monotonic() - arrival - compute_s - transfer_s),
                               compute_s=compute_s, transfer_s=transfer_s, input_logprobs=req.input_logprobs)
        if fut is not None and not fut.done():
            fut.set_result(result)

    def aborted(self, rid: str, found: bool, error: str | None) -> None:
        waiter = self._waiters.pop(rid, None)
        if waiter is not None and not waiter[0].done():
            waiter[0].set_exception(RuntimeError(error or "aborted"))
        if not found and waiter is None:
            self._remember_abort(rid)

    def _remember_abort(self, rid: str) -> None:
        now = time.monotonic()
        self._early_aborts[rid] = now
        while self._early_aborts:
            oldest, at = next(iter(self._early_aborts.items()))
            if now - at < EARLY_ABORT_MEMORY_S and len(self._early_aborts) <= EARLY_ABORT_MEMORY_MAX:
                break
            del self._early_aborts[oldest]
