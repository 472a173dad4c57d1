"""StorageTier: a tier of KV pages under the radix cache, in a directory (kv_files.py) that outlives the pool and
that several workers may share.

Lifecycle of a request with a stored prefix: the scheduler hands each new request to `hold` -> the keys of the
prompt's pages beyond what the pool holds are looked up and read on a reader thread, while the request waits
here (it counts as live: an abort finds it) and the engine steps every other request -> `poll`, on the engine
thread, copies what was read into free pages of the pool in one copy, adds them to the radix cache and queues
the request, whose prefix match then finds them as if they had never left. A read that is not done by its
deadline (--hicache-storage-prefetch-timeout) is given up according to the prefetch policy: the request computes
what did not arrive. A file that fails its check is a miss: the page is computed again, never read wrong.

Writes never stop a step either. Under write_through a page is written once the radix cache takes it: the path
of pages is locked in the cache (so it is neither evicted nor reused) while a writer thread reads it straight
from the pool, and unlocked by `poll` when written. write_through_selective writes a path only once a later
request has found it in the pool; write_back writes what the pool evicts, copied out first (the only copy on the
engine thread, one for every page evicted at once). Writes that fall behind are dropped (at most a quarter of
the pool waits to be written), never queued without bound.

Keys are chained over every page's tokens from the identity of the weights, dtype and page layout
(kv_files.py); a weight update moves to a new identity, so KV of other weights is never found.

The routers are told which pages are stored (`events`, kv_events.py) and under which `domain`: the directory's
own id (a file in it, written by the first worker there) with the identity, so every worker that can read a
page another stored names the place alike.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import uuid
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from pdserve.shared.config import RuntimeConfig, TierConfig
from pdserve.shared.kv_events import STORAGE, CacheEvents
from pdserve.shared.kv_files import KVFiles, chain_keys, identity_key, model_fingerprint
from pdserve.shared.radix_cache import Node
from pdserve.shared.req import Req, ReqStatus

if TYPE_CHECKING:
    from pdserve.shared.kv_pool import KVPool
    from pdserve.shared.scheduler import Scheduler

log = logging.getLogger(__name__)

WAIT_COMPLETE_LIMIT_S = 60.0  # wait_complete still gives up on a read this slow: it computes rather than hang
READ_RUN = 16  # pages read at once (KVFiles.read_run: one NIXL transfer); a load given up stops after the current run
WRITE_RUN = 64  # pages written at once (KVFiles.write_run); a job of more is written a run at a time


@dataclass
class TierCounts:
    """The tier's figures beside KVFiles' own (read by the engine thread for metrics and stats)."""

    lookups: int = 0  # requests whose prompt went past the pool's prefix and were looked for
    hits: int = 0  # of those, requests that got at least one page from storage
    hit_tokens: int = 0
    load_seconds: float = 0.0  # summed over loads: hold -> queued
    given_up: int = 0  # loads past their deadline
    writes_dropped: int = 0  # pages not written because the writer was a quarter of the pool behind


@dataclass
class _Load:
    req: Req
    keys: list[str]  # keys of every full page of the prompt the request may reuse
    first: int  # index of the first page the pool did not hold when it arrived
    deadline: float
    started: float
    read: list[bytes] = field(default_factory=list)
    done: bool = False


def kv_identity(config: RuntimeConfig, pool: KVPool) -> dict:
    """What makes KV computed here reusable elsewhere: the same weights through the same arithmetic and layout."""
    layout = pool.layout
    return {"weights": model_fingerprint(config.model_path), "dtype": str(layout.dtype),
            "page_size": layout.page_size, "layers": layout.num_layers, "kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "quantization": config.quantization, "kernels": config.kernels,
            "deterministic": config.deterministic, "device": torch.device(config.device).type}


class StorageTier:
    def __init__(self, config: TierConfig, scheduler: Scheduler, pool: KVPool, identity: dict,
                 wake: Callable[[], None]) -> None:
        self.config = config
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.pool = pool
        self.page_size = pool.page_size
        self.files = KVFiles(config.storage_dir, pool.layout.page_bytes)
        self.counts = TierCounts()
        self._identity = dict(identity)
        self.files.use(identity_key(self._identity))
        self._directory_id = directory_id(self.files.root)
        self.domain = self._domain()
        self.events: CacheEvents | None = None  # told which pages are stored (set by the worker's engine host)
        self._wake = wake  # makes the engine loop look at `poll` soon (it may be waiting for work)
        self._loading: dict[int, _Load] = {}  # by id(req)
        self._done: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # run by `poll`, engine thread
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="kv-tier-read")
        self._writes: queue.Queue = queue.Queue()
        self._pending_write_pages = 0
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True)
        self._writer.start()
        scheduler.holders.append(self)
        scheduler.tier = self

    # ------------------------------------------------------------ identity
    def weights_changed(self, model_path: str) -> None:
        """Read and write under the new weights' identity from now on (the pool was flushed with them)."""
        self._identity.update(weights=model_fingerprint(model_path))
        self.files.use(identity_key(self._identity))
        self.domain = self._domain()
        if self.events is not None:
            self.events.cleared(STORAGE)  # what was stored under the old weights answers nothing now

    def _domain(self) -> str:
        """Where stored pages can be read: the same for every worker on this directory with this identity."""
        return hashlib.blake2b(f"{self._directory_id}:{self.files.identity}".encode(), digest_size=16).hexdigest()

    def flush(self) -> None:
        """Make every stored page unreachable (the files go in the background)."""
        self.files.flush()
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
        self._loading.pop(id(req), None)  # its read may still finish: then nothing waits for it

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
        if self.config.write_policy == "write_through_selective" and have:
            self._write_path(self.cache.match_prefix(req.fill_ids, max_pages=have,
                                                     namespace=req.cache_namespace).node)
        if num_pages <= have:
            return False
        keys = chain_keys(self.files.identity, self.cache.page_keys(req.fill_ids, num_pages, req.cache_namespace))
        self.counts.lookups += 1
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
            if load.done:  # given up: stop reading
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

    def _queue(self, load: _Load, pages: list[bytes]) -> None:
        """Engine thread: the pages read go into the pool and the cache, and the request into the queue."""
        del self._loading[id(load.req)]
        load.done = True
        req = load.req
        got = self._insert(req, load, pages) if pages else 0
        self.counts.load_seconds += time.monotonic() - load.started
        if got:
            self.counts.hits += 1
            self.counts.hit_tokens += got * self.page_size
        self.scheduler.enqueue(req)

    def _insert(self, req: Req, load: _Load, pages: list[bytes]) -> int:
        """Put `pages` (read for load.first onwards) into free pages of the pool and the radix cache; how many."""
        s = self.page_size
        tokens, namespace = req.fill_ids, req.cache_namespace
        match = self.cache.match_prefix(tokens, max_pages=load.first + len(pages), namespace=namespace)
        have = match.num_tokens  # the pool may hold more (or less) of it by now
        if have < load.first:
            return 0  # evicted since: what was read no longer continues what the pool holds
        pages = pages[have - load.first:]
        if not pages:
            return 0
        self.cache.lock(match.node)  # its pages must not be evicted to make room for the ones read
        fresh = self.scheduler.allocate(len(pages)) or self.scheduler.allocate(len(pages) // 2) or []
        self.cache.unlock(match.node)
        if not fresh:
            return 0
        pages = pages[:len(fresh)]
        layout = self.pool.layout
        staged = torch.frombuffer(bytearray(b"".join(pages)), dtype=torch.uint8).view(layout.dtype)
        staged = staged.view(len(pages), *self.pool.buffer.shape[1:])
        self.pool.buffer[torch.tensor(fresh, device=self.pool.buffer.device)] = staged.to(self.pool.buffer.device)
        result = self.cache.insert(tokens[:(have + len(pages)) * s], match.pages + fresh, namespace)
        self.scheduler.allocator.free(result.duplicates)
        read = self.cache.path(result.node)[have:]
        for node in read:
            node.stored = True
        self._told_stored(read)
        return len(pages) - len(result.duplicates)

    # ------------------------------------------------------------ writes
    def cached(self, node: Node) -> None:
        """The radix cache took the path down to `node` (Scheduler.cache_pages)."""
        if self.config.write_policy == "write_through":
            self._write_path(node)

    def evicting(self, nodes: list[Node]) -> None:
        """write_back: the pool is about to reuse these nodes' pages; copy out what is not stored yet."""
        if self.config.write_policy != "write_back":
            return
        todo = [n for n in nodes if not n.stored and self._full(n)]
        if not todo or not self._room(len(todo)):
            return
        keys = [self._key(n) for n in todo]
        index = torch.tensor([n.page for n in todo], device=self.pool.buffer.device)
        copies = self.pool.buffer[index].to("cpu")  # one copy: these pages are reused by the step that follows
        self._writes.put((keys, copies, (None, todo)))

    def _write_path(self, node: Node) -> None:
        todo = [n for n in self.cache.path(node) if not n.stored and self._full(n)]
        if not todo or not self._room(len(todo)):
            return
        keys = [self._key(n) for n in todo]
        for n in todo:
            n.stored = True  # asked for once; a failed write clears it again
        self.cache.lock(node)  # the path's pages stay as they are until the writer has read them
        self._writes.put((keys, [n.page for n in todo], (node, todo)))

    @property
    def writing(self) -> bool:
        """Whether pages asked to be written are not yet (write_through keeps their paths locked meanwhile)."""
        return self._pending_write_pages > 0

    def _room(self, pages: int) -> bool:
        if self._pending_write_pages + pages > max(1, self.pool.num_pages // 4):
            self.counts.writes_dropped += pages
            return False
        self._pending_write_pages += pages
        return True

    def _write_loop(self) -> None:
        """Writer thread: each job's pages to their files, straight from the pool (locked) or from copies."""
        while True:
            keys, pages, job = self._writes.get()
            ok: list[bool] = []
            for start in range(0, len(keys), WRITE_RUN):
                run = range(start, min(start + WRITE_RUN, len(keys)))
                data = [pages[i] if isinstance(pages, torch.Tensor) else self.pool.buffer[pages[i]] for i in run]
                ok += self.files.write_run(keys[start:start + WRITE_RUN],
                                           [d.cpu().reshape(-1).view(torch.uint8).numpy().data for d in data])
            self._done.put(lambda n=len(keys), job=job, ok=ok: self._written(n, job, ok))
            self._wake()

    def _written(self, count: int, job: tuple[Node | None, list[Node]], ok: list[bool]) -> None:
        """`job`: the node whose path was locked for the writer (None: written from copies) and the nodes."""
        self._pending_write_pages -= count
        locked, nodes = job
        if locked is not None:
            self.cache.unlock(locked)
        for n, written in zip(nodes, ok):
            n.stored = written
        self._told_stored([n for n, written in zip(nodes, ok) if written])

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
        prev = node.store_key if node.parent is not None else self.files.identity
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
        pages, size = self.files.occupancy()
        files = self.files.counts
        return {"storage_pages": pages, "storage_bytes": size, "lookups": self.counts.lookups,
                "hits": self.counts.hits, "hit_tokens": self.counts.hit_tokens,
                "pages_read": files.pages_read, "bytes_read": files.bytes_read,
                "pages_written": files.pages_written, "bytes_written": files.bytes_written,
                "load_seconds": self.counts.load_seconds, "given_up": self.counts.given_up,
                "corrupt": files.corrupt, "io_errors": files.errors, "writes_dropped": self.counts.writes_dropped,
                "io_fallbacks": files.io_fallbacks, "io": self.files.io}  # io: a name, the rest numbers

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)


def directory_id(root: Path) -> str:
    """The storage directory's id, from the file the first worker there wrote (linked into place, so two workers
    starting at once agree); its path where the file cannot be had."""
    marker = root / ".pdserve-directory"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            tmp = root / f".pdserve-directory.{uuid.uuid4().hex}"
            tmp.write_text(uuid.uuid4().hex)
            try:
                os.link(tmp, marker)
            except FileExistsError:
                pass  # another worker's is there first
            finally:
                tmp.unlink()
        return marker.read_text().strip()
    except OSError:
        return str(root.resolve())
