"""KVTiers: the tiers of KV pages under the radix cache: host memory (kv_host.py; a GPU worker's) and a directory
(kv_files.py) that outlives the pool and that several workers may share. Either or both; host above storage.

Lifecycle of a request whose prefix went past the pool: the scheduler hands each new request to `hold` -> the keys
of the prompt's pages beyond what the pool holds are looked up. What the host tier holds goes back into free pages
of the pool at once (a copy the stream runs before the request's step; the engine thread does not wait for it).
What continues the prefix in storage is read on a reader thread, while the request waits here (it counts as live:
an abort finds it, stops its read after the run under way and drops what was read) and the engine steps every other
request -> `poll`, on the engine thread, copies what was read into free pages of the pool in one copy, adds them to
the radix cache and queues the request, whose prefix match then finds them as if they had never left. A read that is not done by its deadline
(--hicache-storage-prefetch-timeout) is given up according to the prefetch policy: the request computes what did
not arrive. A file that fails its check is a miss: the page is computed again, never read wrong.

Writes never stop a step either. The host tier takes every full page the pool evicts. Storage follows the write
policy: under write_through a page is written once the radix cache takes it: the path of pages is locked in the
cache (so it is neither evicted nor reused) while a writer thread reads it straight from the pool, and unlocked by
`poll` when written. write_through_selective writes a path only once a later request has found it in the pool;
write_back writes what the pool evicts, from the host tier's copy where there is one (its slots kept until
written), else copied out first (the only copy on the engine thread, one for every page evicted at once). At
most a quarter of the pool waits to be written (kv_tier_writer.py), so a path longer than that is written in parts:
the part being written is locked, the rest waits its turn unlocked (kv_tier_writer.PathWrites: the pool may need
those pages more than storage does) and is asked for again as parts land. What the pool evicts before its turn,
and what write_back evicts while the writer is that far behind, is dropped and counted per reason, never queued
without bound.

Keys are chained over every page's tokens from the identity of the weights' bytes, kernels as resolved and page
layout (kv_keys.py; recorded in the directory: kv_identities.py); a weight update moves to a new identity.

The routers are told which pages each tier holds (`events`, kv_events.py); stored pages under a `domain`: the
directory's own id (a file in it, written by the first worker there) with the identity, so every worker that can
read a page another stored names the place alike.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from pdserve.shared.config import TierConfig
from pdserve.shared.kv_events import HOST, STORAGE, CacheEvents
from pdserve.shared.kv_files import KVFiles
from pdserve.shared.kv_identities import directory_id
from pdserve.shared.kv_keys import chain_keys, identity_key, weights_digest
from pdserve.shared.kv_host import HostPages, host_pages
from pdserve.shared.kv_tier_stats import TierCounts, tier_stats
from pdserve.shared.kv_tier_writer import PathWrites, TierWriter, Write
from pdserve.shared.radix_cache import Node
from pdserve.shared.req import Req, ReqStatus

if TYPE_CHECKING:
    from pdserve.shared.kv_pool import KVPool
    from pdserve.shared.kv_tier_ranks import TierRanks
    from pdserve.shared.scheduler import Scheduler

log = logging.getLogger(__name__)

WAIT_COMPLETE_LIMIT_S = 60.0  # wait_complete still gives up on a read this slow: it computes rather than hang
READ_RUN = 16  # pages read at once (KVFiles.read_run: one NIXL transfer); a load given up stops after the current run


@dataclass
class _Load:
    req: Req
    keys: list[str]  # keys of every full page of the prompt the request may reuse
    first: int  # index of the first page neither the pool nor the host tier held when it arrived
    deadline: float
    started: float
    read: list[bytes] = field(default_factory=list)
    done: bool = False


class KVTiers:
    def __init__(self, config: TierConfig, scheduler: Scheduler, pool: KVPool, identity: dict,
                 wake: Callable[[], None], model_path: str = "", ranks: TierRanks | None = None) -> None:
        """`ranks`: the other ranks of a tensor-parallel worker, each storing its own KV heads of every page
        (kv_tier_ranks.py); `model_path`: for the directory's record of the identity."""
        self.config = config
        self.ranks = ranks
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.pool = pool
        self.page_size = pool.page_size
        slots = host_pages(config, pool)
        self.host = HostPages(slots, tuple(pool.buffer.shape[1:]), pool.layout.dtype, pool.buffer.device) \
            if slots else None
        self.files = KVFiles.for_tier(config, pool.layout.page_bytes) if config.storage_dir is not None else None
        self.counts = TierCounts()
        self._identity = dict(identity)
        self.root_key = identity_key(self._identity)  # the chain of every page's key starts here
        self.domain = ""  # where stored pages can be read ("" without a storage tier)
        if self.files is not None:
            self.files.use(self.root_key, self._identity, model_path)  # the path: for the identity's record only
            self._directory_id = directory_id(self.files.root, self.files.access)
            self.domain = self._domain()
        self.events: CacheEvents | None = None  # told which pages are stored (set by the worker's engine host)
        self._wake = wake  # makes the engine loop look at `poll` soon (it may be waiting for work)
        self._loading: dict[int, _Load] = {}  # by id(req)
        self._done: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # run by `poll`, engine thread
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="kv-tier-read")
        self.read_delay_s = 0.0  # tests only: each run of a read waits this long first
        # at most a quarter of the pool waits to be written
        self.writer = TierWriter(self.files, pool.num_pages // 4, self._report) if self.files is not None else None
        self.paths = PathWrites(self.cache, self.writer, pool.buffer, self._key, self._full,
                                ranks.write if ranks is not None else None) if self.writer is not None else None
        scheduler.holders.append(self)
        scheduler.tier = self

    # ------------------------------------------------------------ identity
    def weights_changed(self, model_path: str) -> None:
        """Read and write under the new weights' identity from now on (the pool was flushed with them)."""
        self._identity.update(weights=weights_digest(model_path))  # hashed by the reader that staged them
        self.root_key = identity_key(self._identity)
        if self.host is not None:
            self.host.clear()  # other weights' KV
            if self.events is not None:
                self.events.cleared(HOST)
        if self.files is not None:
            self.files.use(self.root_key, self._identity, model_path)
            self.domain = self._domain()
            if self.events is not None:
                self.events.cleared(STORAGE)  # what was stored under the old weights answers nothing now

    def _domain(self) -> str:
        """Where stored pages can be read: the same for every worker on this directory with this identity."""
        return hashlib.blake2b(f"{self._directory_id}:{self.root_key}".encode(), digest_size=16).hexdigest()

    def flush(self, host: bool = True, storage: bool = True) -> None:
        """Forget the host tier's pages; make every stored page unreachable (the files go in the background)."""
        if host and self.host is not None:
            self.host.clear()
            if self.events is not None:
                self.events.cleared(HOST)
        if storage and self.files is not None:
            self.files.flush()
            if self.ranks is not None:
                self.ranks.flush()
            for node in self.cache.nodes():
                node.stored = False
            if self.events is not None:
                self.events.cleared(STORAGE)

    # ------------------------------------------------------------ PageHolder: loading requests are live
    def held_reqs(self) -> list[Req]:
        return [load.req for load in self._loading.values()]

    def held_pages(self) -> dict[str, list[int]]:
        return {}  # a loading request holds no page: what it reads goes to the pool when it is queued

    def discard(self, req: Req) -> None:
        """An aborted request: its read stops after the run under way and what it read is dropped."""
        load = self._loading.pop(id(req), None)
        if load is not None:
            load.done = True
            load.read.clear()

    # ------------------------------------------------------------ reads
    def hold(self, req: Req) -> bool:
        """Take a new request while its stored pages are read; False when nothing past the pool's prefix can be
        (the scheduler queues it at once)."""
        s = self.page_size
        limit = req.seq_len - 1  # as Scheduler._match_prefix: at least one token is computed
        if req.first_logit_row is not None:
            limit = min(limit, req.first_logit_row)
        num_pages = limit // s
        have = self.cache.match_prefix(req.fill_ids, max_pages=num_pages, namespace=req.cache_namespace).num_tokens
        if self.files is not None and self.config.write_policy == "write_through_selective" and have:
            self.paths.write(self.cache.match_prefix(req.fill_ids, max_pages=have,
                                                     namespace=req.cache_namespace).node)
        if num_pages <= have:
            return False
        keys = chain_keys(self.root_key, self.cache.page_keys(req.fill_ids, num_pages, req.cache_namespace))
        self.counts.lookups += 1
        if self.host is not None:
            have += self._from_host(req, keys, have)
        if num_pages <= have or self.files is None:
            return False
        now = time.monotonic()
        timeout = WAIT_COMPLETE_LIMIT_S if self.config.prefetch_policy == "wait_complete" \
            else self.config.prefetch_timeout_s
        load = _Load(req, keys, have, now + timeout, now)
        self._loading[id(req)] = load
        req.status = ReqStatus.WAITING
        self._readers.submit(self._read, load)
        return True

    def _read(self, load: _Load) -> None:
        """Reader thread: the stored pages after the pool's prefix, in order, up to the first missing one, a run
        of READ_RUN pages at a time."""
        keys = load.keys[load.first:]
        for start in range(0, len(keys), READ_RUN):
            if self.read_delay_s:
                time.sleep(self.read_delay_s)
            if load.done:  # given up at its deadline, or its request aborted: stop reading
                break
            run = keys[start:start + READ_RUN]
            pages = self.files.read_run(run)
            load.read.extend(pages)
            if len(pages) < len(run):
                break
        self._done.put(lambda: self._loaded(load))
        self._wake()

    def _loaded(self, load: _Load) -> None:
        if self._loading.get(id(load.req)) is not load:
            return  # aborted meanwhile, or already given up at its deadline
        self._queue(load, load.read)

    def _from_host(self, req: Req, keys: list[str], have: int) -> int:
        """Put the pages the host tier holds after the pool's `have` into the pool and the cache; how many."""
        started = time.monotonic()
        slots = self.host.find(keys[have:])
        if not slots:
            return 0
        self.host.lend(slots)  # the evictions that make room in the pool must not reuse them
        try:
            got, _ = self._insert(req, have, slots, lambda fresh, first: self.host.load(
                slots[first:first + len(fresh)], self.pool.buffer, fresh))
        finally:
            self.host.give_back(slots)
        self.counts.host_load_seconds += time.monotonic() - started
        if got:
            self.counts.host_hits += 1
            self.counts.host_hit_tokens += got * self.page_size
            req.tier_tokens[HOST] = got * self.page_size
        return got

    def _queue(self, load: _Load, pages: list[bytes]) -> None:
        """Engine thread: the pages read go into the pool and the cache, and the request into the queue."""
        del self._loading[id(load.req)]
        load.done = True
        req = load.req
        if pages and self.ranks is not None:  # only the pages every rank has its part of
            pages = pages[:self.ranks.read(load.keys[load.first:load.first + len(pages)])]
        got, nodes = self._insert(req, load.first, pages, self._put_read(pages)) if pages else (0, [])
        for node in nodes:
            node.stored = True
        self._told_stored(nodes)
        self.counts.load_seconds += time.monotonic() - load.started
        if got:
            self.counts.hits += 1
            self.counts.hit_tokens += got * self.page_size
            req.tier_tokens[STORAGE] = got * self.page_size
        self.scheduler.enqueue(req)

    def _put_read(self, pages: list[bytes]) -> Callable[[list[int], int], None]:
        def put(fresh: list[int], first: int) -> None:
            layout, buffer = self.pool.layout, self.pool.buffer
            staged = torch.frombuffer(bytearray(b"".join(pages[first:first + len(fresh)])), dtype=torch.uint8)
            staged = staged.view(layout.dtype).view(len(fresh), *buffer.shape[1:])
            buffer[torch.tensor(fresh, device=buffer.device)] = staged.to(buffer.device)
            if self.ranks is not None:
                self.ranks.put(first, fresh)
        return put

    def _insert(self, req: Req, first: int, pages: list, put: Callable[[list[int], int], None]
                ) -> tuple[int, list[Node]]:
        """Put `pages` (the prompt's, from page `first` on, in a lower tier) into free pages of the pool and the
        radix cache: how many were new there, and the cache's nodes for them. `put(fresh, i)` copies
        pages[i:i + len(fresh)] into the pool's `fresh` pages."""
        s = self.page_size
        tokens, namespace = req.fill_ids, req.cache_namespace
        match = self.cache.match_prefix(tokens, max_pages=first + len(pages), namespace=namespace)
        have = match.num_tokens  # the pool may hold more (or less) of it by now
        if have < first:
            return 0, []  # evicted since: what was read no longer continues what the pool holds
        skip = have - first
        wanted = len(pages) - skip
        if not wanted:
            return 0, []
        self.cache.lock(match.node)  # its pages must not be evicted to make room for the ones read
        fresh = self.scheduler.allocate(wanted) or self.scheduler.allocate(wanted // 2) or []
        self.cache.unlock(match.node)
        if not fresh:
            return 0, []
        put(fresh, skip)
        result = self.cache.insert(tokens[:(have + len(fresh)) * s], match.pages + fresh, namespace)
        self.scheduler.allocator.free(result.duplicates)
        return len(fresh) - len(result.duplicates), self.cache.path(result.node)[have:]

    # ------------------------------------------------------------ writes
    def cached(self, node: Node) -> None:
        """The radix cache took the path down to `node` (Scheduler.cache_pages)."""
        if self.files is not None and self.config.write_policy == "write_through":
            self.paths.write(node)

    def evicting(self, nodes: list[Node]) -> None:
        """The pool is about to reuse these nodes' pages: into the host tier they go, and under write_back to
        storage what is not stored yet."""
        if self.paths is not None:
            self.paths.evicting(nodes)
        full = [n for n in nodes if self._full(n)]
        if not full:
            return
        slots: list[int | None] = [None] * len(full)
        if self.host is not None:
            slots, left = self.host.keep([self._key(n) for n in full], [n.route_hash for n in full],
                                         self.pool.buffer, [n.page for n in full])
            if self.events is not None:
                self.events.removed(HOST, left)
                self.events.added(HOST, [n.route_hash for n, slot in zip(full, slots)
                                         if slot is not None and n.route_hash is not None])
        if self.files is None or self.config.write_policy != "write_back":
            return
        todo = [(n, slot) for n, slot in zip(full, slots) if not n.stored]
        granted = self.writer.take(len(todo))
        self.writer.drop("behind", len(todo) - granted)
        todo = todo[len(todo) - granted:]  # evicted leaves first: the later ones are nearer the root, read first
        if not todo:
            return
        keys, nodes = [self._key(n) for n, _ in todo], [n for n, _ in todo]
        if all(slot is not None for _, slot in todo):  # written from the host tier's copies
            kept = [slot for _, slot in todo]
            self.host.lend(kept)
            self.writer.put(Write(keys, self.host.buffer, kept, nodes, ready=self.host.ready(), lent=True))
            return
        if self.ranks is not None:
            self.ranks.write(keys, [n.page for n in nodes])
        index = torch.tensor([n.page for n in nodes], device=self.pool.buffer.device)
        copies = self.pool.buffer[index].to("cpu")  # one copy: these pages are reused by the step that follows
        self.writer.put(Write(keys, copies, list(range(len(keys))), nodes))

    @property
    def writing(self) -> bool:
        """Whether pages asked to be written are not yet (write_through keeps their paths locked meanwhile)."""
        return self.writer is not None and self.writer.pending_pages > 0

    def _report(self, write: Write, ok: list[bool]) -> None:
        """Writer thread: a job is written; the engine thread takes it from here."""
        self._done.put(lambda: self._written(write, ok))
        self._wake()

    def _written(self, write: Write, ok: list[bool]) -> None:
        self.writer.landed(write)
        if write.locked is not None:
            self.cache.unlock(write.locked)
        if write.lent:
            self.host.give_back(write.pages)
        for n, written in zip(write.nodes, ok):
            n.stored = written
        self._told_stored([n for n, written in zip(write.nodes, ok) if written])
        if all(ok):
            self.paths.resume()
        else:  # the directory fails: stop (asking again here would retry the failed pages at once, for ever);
            self.paths.waiting.clear()  # a later request's pages ask again, as a failed page always does

    def _told_stored(self, nodes: list[Node]) -> None:
        if self.events is not None:
            self.events.added(STORAGE, [n.route_hash for n in nodes if n.route_hash is not None])

    def _full(self, node: Node) -> bool:
        """Whether the node holds a whole page (a tail, the partly filled end of a sequence, is never stored)."""
        return sum(1 for item in node.key if not isinstance(item, str)) == self.page_size

    def _key(self, node: Node) -> str:
        """The node's key in storage, chained from the nearest ancestor that knows its own (kept on the nodes)."""
        path = []
        while node.store_key is None and node.parent is not None:
            path.append(node)
            node = node.parent
        prev = node.store_key if node.parent is not None else self.root_key
        for n in reversed(path):
            n.store_key = prev = chain_keys(prev, [n.key])[0]
        return path[0].store_key if path else node.store_key

    # ------------------------------------------------------------ the engine loop
    def poll(self) -> None:
        """Engine thread, every loop iteration: finish what the threads did, give up reads past their deadline."""
        while True:
            try:
                self._done.get_nowait()()
            except queue.Empty:
                break
        now = time.monotonic()
        for load in [x for x in self._loading.values() if x.deadline <= now]:
            self.counts.given_up += 1
            # best_effort keeps the leading pages read by now; timeout computes the prompt (all or nothing)
            self._queue(load, list(load.read) if self.config.prefetch_policy == "best_effort" else [])

    def stats(self) -> dict:
        return tier_stats(self.counts, self.host, self.files, self.writer)

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)
