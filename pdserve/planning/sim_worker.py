"""One simulated runtime worker: the project's own Scheduler, PageAllocator and RadixCache, stepped on a virtual
clock with no model.

What the engine does around the scheduler is mirrored here in the few lines a step needs without tensors:
the colocated role schedules `schedule_mixed`, prefill `schedule_prefill`, decode reserves prompt pages first
(as `shared/roles/decode.py`: at most `max_running_requests` running or waiting for KV) and computes a prompt
itself when its cache holds all but `local_prefill_max_tokens` of it. After a step, `account` books it as
`Engine.account` does (chunks, the prefix cache, joining the running batch, one token per decoding request,
finishing at the request's output length). Pages are the scheduler's: a simulated pool runs out, evicts and
retracts exactly as a real one.

The worker also answers the router's questions (`address`, `in_flight`, `load`, `free_pages`, `page_size`), the
load as a worker's health answer gives it: refreshed once a simulated second. Its free pages count the cached pages
no running request reads as free, as the worker's do, but without walking the tree (which a real worker does
once a second and a simulation of 64 of them could not afford): the pages requests read are summed, so a prefix
read by two counts twice and free pages are, if anything, underestimated.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.config import SchedulerConfig
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.radix_cache import RadixCache
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.scheduler import Batch, Scheduler

OUTPUT_TOKEN = 2  # what every simulated request "samples"; only its count matters
LONGEST_RUN = 512  # decode steps simulated as one run at most


@dataclass
class Load:  # the fields of a worker's LoadReply the router reads
    running: int = 0
    waiting: int = 0


class SimWorker:
    def __init__(self, address: str, role: str, config: SchedulerConfig, page_size: int, num_pages: int) -> None:
        self.address, self.role, self.page_size = address, role, page_size
        self.scheduler = Scheduler(config, PageAllocator(num_pages), RadixCache(page_size), page_size)
        self.reserving: list[Req] = []  # decode role: prompts waiting for pages
        self.awaiting_kv: dict[str, Req] = {}  # decode role: pages reserved, prefill computing them
        self.batch: Batch | None = None  # the step (or run of decode steps) in flight
        self.ends: list[float] = []  # when each of its steps ends
        self.started = 0.0
        self.run_id = 0  # which scheduled end of the run is current (a cut run's later end is stale)
        self.busy_until = 0.0
        self.in_flight = 0
        self.load: Load | None = None
        self.free_pages = num_pages
        self._seen = -1.0
        self.busy_s = 0.0  # time spent stepping (utilisation)

    def refresh(self, now: float) -> None:
        """What the worker's health answer says, once a second as the gateway asks."""
        if now - self._seen < 1.0:
            return
        s = self.scheduler
        self._seen = now
        self.load = Load(len(s.running) + (s.chunked is not None), len(s.waiting) + len(self.reserving))
        read = sum(r.num_cached_pages for r in s.running) + (s.chunked.num_cached_pages if s.chunked else 0)
        self.free_pages = s.allocator.num_free + max(0, s.cache.num_pages - read)

    # ------------------------------------------------------------ admission
    def queue(self, req: Req) -> None:
        if self.role != "decode" or self.prefills_here(req):
            self.scheduler.add(req)
        else:
            req.status = ReqStatus.WAITING_FOR_PAGES
            self.reserving.append(req)

    def prefills_here(self, req: Req) -> bool:
        s = self.scheduler
        limit = s.config.local_prefill_max_tokens
        if limit <= 0 or len(req.input_ids) <= s.page_size:
            return False
        match = s.cache.match_prefix(req.input_ids, max_tokens=len(req.input_ids) - 1)
        cached = len(match.pages) * s.page_size + match.tail_tokens
        return cached > 0 and len(req.input_ids) - cached <= limit

    def reserve(self) -> list[Req]:
        """Reserve prompt pages, oldest first; returns the requests whose prefill may start now."""
        s, started = self.scheduler, []
        while self.reserving and s.num_running + len(self.awaiting_kv) < s.config.max_running_requests:
            req = self.reserving[0]
            pages = s.allocate(-(-len(req.input_ids) // s.page_size))
            if pages is None:
                break
            self.reserving.pop(0)
            req.pages, req.status = pages, ReqStatus.WAITING_FOR_KV
            self.awaiting_kv[req.rid] = req
            started.append(req)
        return started

    def kv_ready(self, rid: str) -> Req:
        """The prompt's KV has landed: the request decodes from the next step, its first token delivered."""
        req = self.awaiting_kv.pop(rid)
        req.num_computed = len(req.input_ids)
        self.scheduler.cache_pages(req, lock=True)
        self.join(req)
        return req

    # ------------------------------------------------------------ steps
    def schedule(self) -> Batch | None:
        s = self.scheduler
        return s.schedule_prefill() if self.role == "prefill" else s.schedule_mixed()

    def join(self, req: Req) -> None:
        if req.status != ReqStatus.RUNNING:
            req.status = ReqStatus.RUNNING
            self.scheduler.running.append(req)

    def account(self, batch: Batch) -> tuple[list[Req], list[Req]]:
        """Book a finished step: (requests that got a token, prompts computed here whose KV must go elsewhere)."""
        tokens: list[Req] = []
        done: list[Req] = []
        s = self.scheduler
        for req, n in zip(batch.reqs, batch.extend_lens):
            if req.status == ReqStatus.FINISHED:
                continue
            req.num_computed += n
            if batch.is_decode or req.status == ReqStatus.RUNNING:
                tokens.append(req)
                continue
            if req.num_computed < req.seq_len:
                req.status = ReqStatus.PREFILLING
                s.chunked = req
                continue
            if s.chunked is req:
                s.chunked = None
            s.cache_pages(req, lock=True)
            if self.role == "prefill":
                done.append(req)
            else:
                self.join(req)
                tokens.append(req)
        return tokens, done

    def decode_run(self, batch: Batch) -> int:
        """How many decode steps of `batch` may run as one: until its first request finishes, with pages for all of
        them taken now (one step when the pool cannot give them, so that the scheduler retracts as it would).
        Nothing else changes a decode batch between two arrivals, so the run ends only by one of those
        (`Simulation.interrupt`) or by a request finishing."""
        steps = min(LONGEST_RUN, min(r.params.max_new_tokens - len(r.output_ids) for r in batch.reqs))
        if steps > 1 and not all(self.scheduler.grow(r, r.seq_len + steps - 1) for r in batch.reqs):
            return 1
        return max(1, steps)

    def append_tokens(self, req: Req, count: int) -> bool:
        """`count` output tokens (after as many decode steps, or 1 for a first token); True when the request is
        done (it is removed then)."""
        req.output_ids.extend([OUTPUT_TOKEN] * count)
        if len(req.output_ids) >= req.params.max_new_tokens:
            self.scheduler.remove(req, cache=True)
            return True
        return False
