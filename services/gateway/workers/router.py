"""Routing policies: which worker(s) serve a request.

A request goes to a `Pair`: the worker it streams from (colocated, or decode in PD mode) and, in PD mode,
the prefill worker that computes its prompt. `cache_aware` sends a prompt to the worker that last saw its
longest known prefix (its radix cache probably still holds those pages) unless that worker is clearly
busier than the least loaded one. Decode workers the same way, from a table of their own, among those with
room for the prompt: a decode worker holds the KV of the conversations it decoded (prompt and output), and
computes a next turn's few new tokens itself (`shared/roles/decode.py`); otherwise by load and free KV
pages. `round_robin` ignores both, for comparison.

What a worker holds the router learns two ways. The workers tell it (kv_events.py): each streams the pages its pool
gains and loses, those its host-memory tier keeps and those its storage tier stores, so the router knows a prefix
that another gateway sent, that the worker computed before this gateway started, or that sits in a storage directory
the worker shares with others; and it knows a prefix is gone once evicted. Between a request and the events it
causes, and for workers that do not stream, it goes by its own routing history: bounded LRU maps from hashes of
leading pages of token ids to the worker address that last served them, corrected by the events. A worker is scored
by the pages the prompt would not compute there: its device pages count in full, host-memory pages past them at
HOST_PAGE_WORTH, and stored pages past those at STORED_PAGE_WORTH, as reading a page back from a file costs about a
tenth of computing it (the KV tiers benchmark) and copying it back from host memory less, so a device hit beats a
host hit of the same length, which beats a storage hit, and each beats nothing.

Each gateway process (--gateway-workers) and replica keeps its own tables, so a conversation's next turn may
reach one that has not seen it. A prompt whose prefix a router does not know goes to the least loaded worker,
and among equally loaded ones to the one that rendezvous hashing of the prompt's first page picks: every router
picks the same for the same first page, so while the workers' loads look alike to them (at light load, or
evenly loaded) the turns of one conversation meet on one worker and its cache. Under uneven load their views
differ and a turn may land elsewhere: its prompt is then computed again, never wrong.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count
from typing import Callable

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.workers.kv_events import HeldPrefixes
from pdserve.services.gateway.workers.pool import Worker, WorkerPool
from pdserve.shared.kv_events import ROOT, prefix_hashes

POLICIES = ("cache_aware", "round_robin")
STORED_PAGE_WORTH = 0.9  # a page read from a storage tier saves this much of computing it
HOST_PAGE_WORTH = 0.95  # one copied back from host memory (over PCIe, or a memory copy) a little more


class NoWorker(Exception):
    """No healthy worker (pair) can take the request."""


@dataclass(frozen=True)
class Pair:
    generate: Worker  # serves Generate: colocated or decode
    prefill: Worker | None = None  # PD mode only
    why: str = field(default="", compare=False)  # how the router chose (a trace shows it)

    @property
    def workers(self) -> list[Worker]:
        return [self.generate] if self.prefill is None else [self.prefill, self.generate]


def load_of(worker: Worker) -> int:
    """Requests on `worker` now: what this gateway sent, or what it reports if that is more (other clients)."""
    reported = (worker.load.running + worker.load.waiting) if worker.load is not None else 0
    return max(worker.in_flight, reported)


def decode_load(worker: Worker) -> tuple[int, int]:
    """Of two decode workers as busy, the one with more free pages is the less loaded."""
    return load_of(worker), -worker.free_pages


class Router:
    def __init__(self, pool: WorkerPool, policy: str = "cache_aware", balance_abs: int = 4,
                 balance_rel: float = 1.5, max_prefix_pages: int = 64, table_size: int = 100_000) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.pool = pool
        self.policy = policy
        # Affinity wins unless its worker has more than `balance_abs` requests over the least loaded one
        # and more than `balance_rel` times as many.
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_prefix_pages = max_prefix_pages
        self.table_size = table_size
        self.prefixes: OrderedDict[int, str] = OrderedDict()  # colocated or prefill workers
        self.decode_prefixes: OrderedDict[int, str] = OrderedDict()
        self.held = HeldPrefixes()  # what the workers say they hold
        pool.on_rejoin.append(self.forget)  # a worker back after a failure may have restarted with an empty cache
        self._turn = count()

    def choose(self, input_ids: list[int], exclude: frozenset[str] = frozenset(),
               cache_salt: str | None = None) -> Pair:
        """`cache_salt`: the prompt's cache namespace; its pages are named apart from every other salt's."""
        root = ROOT if cache_salt is None else salt_root(cache_salt)
        cache_workers = [w for w in self.pool.healthy(self.pool.cache_role) if w.address not in exclude]
        if not cache_workers:
            raise NoWorker(f"no healthy {self.pool.cache_role} worker")
        if self.pool.mode == "colocated":
            worker, why = self._pick_cache_worker(cache_workers, input_ids, root)
            return Pair(worker, why=why)
        decodes = [w for w in self.pool.healthy("decode") if w.address not in exclude]
        if not decodes:
            raise NoWorker("no healthy decode worker")
        prefill, why_prefill = self._pick_cache_worker(cache_workers, input_ids, root)
        decode, why_decode = self._pick_decode(decodes, input_ids, root)
        return Pair(decode, prefill, why=f"prefill: {why_prefill}; decode: {why_decode}")

    # ------------------------------------------------------------ policies
    def _pick_cache_worker(self, workers: list[Worker], input_ids: list[int], root: int) -> tuple[Worker, str]:
        if self.policy == "round_robin":
            return workers[next(self._turn) % len(workers)], "round robin"
        hashes = self._prefix_hashes(input_ids, workers[0].page_size, root)
        least = least_loaded(workers, hashes, load_of)
        return self._by_prefix(workers, hashes, least, self.prefixes, load_of)

    def _pick_decode(self, workers: list[Worker], input_ids: list[int], root: int) -> tuple[Worker, str]:
        if self.policy == "round_robin":
            return workers[next(self._turn) % len(workers)], "round robin"
        roomy = [w for w in workers if w.free_pages * w.page_size > len(input_ids)] or workers
        hashes = self._prefix_hashes(input_ids, roomy[0].page_size, root)
        least = least_loaded(roomy, hashes, decode_load)
        return self._by_prefix(roomy, hashes, least, self.decode_prefixes, decode_load)

    def _by_prefix(self, workers: list[Worker], hashes: list[int], least: Worker,
                   table: OrderedDict[int, str], load: Callable[[Worker], object]) -> tuple[Worker, str]:
        """The worker that would compute the least of the prompt (`hashes`: its pages), by what the workers say
        they hold and by `table`'s history, unless it is clearly busier than `least` (then `least`); the choice
        becomes the owner of the prompt's prefixes in `table`. And why, in words."""
        history = {}  # address -> pages of the prompt it last served
        for pages in range(len(hashes), 0, -1):  # longest known prefix first
            owner = table.get(hashes[pages - 1])
            if owner is not None:
                history[owner] = pages
                break
        held = {}  # address -> (worth, device pages, pages on device or host, pages in any tier)
        for w in workers:
            device, host, stored = self.held.pages(w.address, hashes)
            device = max(device, history.get(w.address, 0))
            host = max(host, device)
            stored = max(stored, host)
            held[w.address] = (device + HOST_PAGE_WORTH * (host - device) + STORED_PAGE_WORTH * (stored - host),
                               device, host, stored)
        top = max(worth for worth, *_ in held.values())
        chosen, why = least, "least loaded, no known prefix"
        if top > 0:
            best = least_loaded([w for w in workers if held[w.address][0] == top], hashes, load)
            _, device, host, stored = held[best.address]
            lower = [(n, tier) for n, tier in ((host - device, "host memory"), (stored - host, "storage")) if n]
            if device:
                best_why = f"holds the prompt's first {device} pages" + "".join(f", {n} more in {tier}"
                                                                                for n, tier in lower)
            elif len(lower) == 1:
                best_why = f"holds the prompt's first {stored} pages in {lower[0][1]}"
            else:
                best_why = f"holds the prompt's first {stored} pages: " + ", ".join(f"{n} in {t}" for n, t in lower)
            if self._balanced(best, least):
                chosen, why = best, best_why
            else:
                why = f"least loaded: {best.address} {best_why} but is busier"
        self._remember(hashes, chosen.address, table)
        return chosen, why

    def learn(self, address: str, batch: pb.KVEventBatch) -> None:
        """One message of `address`'s cache events (kv_events.CacheFeeds): what it evicted leaves the history too."""
        for h in self.held.apply(address, batch):
            for table in (self.prefixes, self.decode_prefixes):
                if table.get(h) == address:
                    del table[h]

    def _balanced(self, owner: Worker, least: Worker) -> bool:
        a, b = load_of(owner), load_of(least)
        return a - b <= self.balance_abs or a <= b * self.balance_rel

    # ------------------------------------------------------------ prefix table
    def _prefix_hashes(self, input_ids: list[int], page_size: int, root: int = ROOT) -> list[int]:
        """The names of the prompt's first full pages (at most max_prefix_pages), as the workers name them (a
        salted prompt's from its salt's root: the workers tell nothing of those)."""
        return prefix_hashes(input_ids, page_size, self.max_prefix_pages, root)

    def _remember(self, hashes: list[int], address: str, table: OrderedDict[int, str]) -> None:
        for h in hashes:
            table[h] = address
            table.move_to_end(h)
        while len(table) > self.table_size:
            table.popitem(last=False)

    def forget(self, address: str) -> None:
        """Drop every prefix owned by `address` (its cache was flushed or it restarted)."""
        for table in (self.prefixes, self.decode_prefixes):
            for h in [h for h, a in table.items() if a == address]:
                del table[h]


def salt_root(cache_salt: str) -> int:
    """Where a salted prompt's page names start: a digest of the salt (stable across processes, as page names are)."""
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little", signed=True)


def least_loaded(workers: list[Worker], hashes: list[int], load: Callable[[Worker], object]) -> Worker:
    """The worker of least `load`; among equals, the rendezvous choice for the prompt's first page (`hashes[0]`),
    which every router makes alike (by address for a prompt shorter than a page)."""
    lowest = min(load(w) for w in workers)
    tied = [w for w in workers if load(w) == lowest]
    if not hashes:
        return min(tied, key=lambda w: w.address)
    return max(tied, key=lambda w: rendezvous(hashes[0], w.address))


def rendezvous(first_page: int, address: str) -> int:
    """The weight of `address` for a prompt: a hash of both that is the same in every process (Python's own
    hash of a string changes from one process to the next)."""
    return int.from_bytes(hashlib.blake2b(f"{first_page}:{address}".encode(), digest_size=8).digest(), "big")
