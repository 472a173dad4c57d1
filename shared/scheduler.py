"""Scheduler: decides what runs next and owns every request's pages.

Each step is a prefill batch (new prompts, or the next chunk of a long one) or a
decode batch (one new token for every running request). Prefill goes first while
there is room; on a colocated worker a prefill batch also carries one token of
every running request (`mixed_prefill`), so new arrivals never stall the
running ones for a whole step, and chunking keeps such steps short.

Page ownership: a request's `pages[:num_cached_pages]` belong to the radix
cache (kept alive by the request's lock on `prefix_node`), the rest belong to
the request. `check_integrity` proves free + held + cached == total. A prompt
that shares only the first tokens of a cached page (a tail: the end of a
finished sequence, such as a conversation's last turn; or a full page it leaves
part-way) gets a copy of it as its first own page, made by the model runner
before the step that computes the rest, so a prefix hit counts to the token.

LoRA slots are owned the same way: a request of an adapter holds one use of its
adapter's slot from admission until it is released (finished, aborted or
retracted), and is only admitted while the pool has that adapter in a slot or a
slot to put it in, so one batch never mixes more adapters than there are slots.

The scheduler knows no roles: a role (`shared/roles/`) picks which of
`schedule_prefill`, `schedule_decode` and `schedule_mixed` makes its batch, and
a role that holds requests outside these queues (decode's reservations) joins
the page accounting as a `PageHolder`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pdserve.shared.config import SchedulerConfig
from pdserve.shared.lora import LoraPool
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.radix_cache import Node, RadixCache
from pdserve.shared.req import Req, ReqStatus

if TYPE_CHECKING:
    import torch


@dataclass
class Batch:
    reqs: list[Req]
    is_decode: bool
    extend_lens: list[int]  # new tokens per request (1 each when decoding)
    # A verify batch of speculative decoding: each request's draft tokens, fed after its newest token, with
    # logits at every position (shared/speculative.py). None: logits of each request's last token only.
    drafts: list[list[int]] | None = None
    # Set by the model runner: (request, first prompt position, rows) of the prompt-logprob rows, and their
    # logits [rows, V] in that order.
    prompt_rows: list[tuple[Req, int, int]] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None
    # The sampled tokens of the step still in flight (shared/overlap.py), which negative input ids stand for.
    in_flight: torch.Tensor | None = None
    # (cached page, request's page): copies the model runner makes before the step, in order, so that a request
    # sharing the first tokens of a cached page writes on into a page of its own (RadixCache.match_prefix).
    page_copies: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.reqs)


@dataclass
class IntegrityReport:
    ok: bool
    total: int
    free: int
    held: int
    cached: int
    message: str = ""


class PoolExhausted(RuntimeError):
    """A single request (`req`, still running) needs more pages than the pool can ever give it."""

    def __init__(self, message: str, req: Req) -> None:
        super().__init__(message)
        self.req = req


class PageHolder(Protocol):
    """Holds requests (and pages) outside the scheduler's queues; they count as live and as held."""

    def held_reqs(self) -> list[Req]:
        """Live requests this holder keeps; their `pages` count as theirs."""

    def held_pages(self) -> dict[str, list[int]]:
        """Pages held for no live request (by request id), e.g. while a KV write into them may still land."""

    def discard(self, req: Req) -> None:
        """`req` is being removed: drop it, keeping whatever of its pages must not go back to the pool yet."""


class Tier(Protocol):
    """A tier of KV pages below the radix cache (kv_tiers.py)."""

    def hold(self, req: Req) -> bool:
        """Take a new request while its stored prefix is read (then `Scheduler.enqueue`s it); False: not needed."""

    def cached(self, node: Node) -> None:
        """The cache took the path of pages down to `node`."""

    def evicting(self, nodes: list[Node]) -> None:
        """The cache evicts these nodes; their pages are reused next."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, cache: RadixCache,
                 page_size: int, lora: LoraPool | None = None) -> None:
        self.config = config
        self.lora = lora
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.waiting: list[Req] = []
        self.chunked: Req | None = None  # a prompt part-way through chunked prefill
        self.running: list[Req] = []
        self.holders: list[PageHolder] = []
        # A lower tier of KV pages under the cache (kv_tiers.KVTiers), or None: it may hold a new request
        # while its stored prefix is read, and is told what the cache takes and evicts.
        self.tier: Tier | None = None

    # ------------------------------------------------------------ admission
    def add(self, req: Req) -> None:
        """A new request: queued now, or once the tier has read its stored prefix into the cache."""
        if self.tier is not None and self.tier.hold(req):
            return
        self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def live_reqs(self) -> list[Req]:
        reqs = self.waiting + self.running
        for holder in self.holders:
            reqs += holder.held_reqs()
        if self.chunked is not None:
            reqs.append(self.chunked)
        return reqs

    def find(self, rid: str) -> list[Req]:
        return [r for r in self.live_reqs() if r.rid == rid]

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    # ------------------------------------------------------------ pages
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """Take n free pages, evicting unused cached prefixes if needed: at least 1 % of the pool at a time, since
        each eviction walks the whole cache tree (once the cache fills the pool, a decode batch needs a page or
        more every step, and a walk per page made the scheduler's time per step grow with the cache)."""
        if not self.allocator.can_allocate(n):
            ahead = max(n - self.allocator.num_free, self.allocator.num_pages // 100)
            evicted = self.cache.evict(ahead) if self.tier is None else self.cache.evict(ahead, self.tier.evicting)
            self.allocator.free(evicted)
        return self.allocator.allocate(n)

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Make `req.pages` cover `num_tokens` tokens."""
        need = self._pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        pages = self.allocate(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def cache_pages(self, req: Req, lock: bool) -> int:
        """Hand the request's full pages of computed tokens to the radix cache, and when it is done with them
        (not `lock`) its partly filled last page as a tail; returns how many of its leading pages the tree owns."""
        result = self.cache.insert(req.fill_ids[:req.num_computed], req.pages, req.cache_namespace, tail=not lock)
        self.allocator.free(result.duplicates)
        if self.tier is not None:
            self.tier.cached(result.node)
        req.pages[:len(result.pages)] = result.pages
        if lock:
            self.cache.lock(result.node)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node = result.node if lock else None
        req.num_cached_pages = len(result.pages) if lock else 0
        return len(result.pages)

    def release(self, req: Req, cache: bool = True) -> None:
        """Give back everything the request holds; its computed pages stay cached when `cache`."""
        if cache and req.num_computed > 0:
            owned = req.pages[self.cache_pages(req, lock=False):]
        else:
            owned = req.pages[req.num_cached_pages:]
            if req.prefix_node is not None:
                self.cache.unlock(req.prefix_node)
        req.prefix_node = None
        req.tail_copy = None
        self._release_copy_source(req)
        self.allocator.free(owned)
        req.pages, req.num_cached_pages, req.num_computed = [], 0, 0
        self._drop_adapter(req)

    # ------------------------------------------------------------ LoRA slots
    def can_hold_adapter(self, req: Req) -> bool:
        return req.lora is None or req.lora_slot >= 0 or (self.lora is not None and self.lora.can_acquire(req.lora.name))

    def hold_adapter(self, req: Req) -> None:
        """Take one use of the request's adapter slot (writing the adapter in first if needed)."""
        if req.lora is not None and req.lora_slot < 0:
            req.lora_slot = self.lora.acquire(req.lora)

    def _drop_adapter(self, req: Req) -> None:
        if req.lora_slot >= 0:
            self.lora.release(req.lora.name)
            req.lora_slot = -1

    # ------------------------------------------------------------ scheduling
    def schedule_mixed(self) -> Batch | None:
        """A prefill batch that also carries one token of every running request (with --mixed-prefill),
        else a decode batch when no prompt can start."""
        batch = self.schedule_prefill()
        if batch is None:
            return self.schedule_decode()
        if self.config.mixed_prefill and self.running:
            decode = self.schedule_decode()  # may retract running requests, never the ones being prefilled
            if decode is not None:
                return Batch(batch.reqs + decode.reqs, is_decode=False,
                             extend_lens=batch.extend_lens + decode.extend_lens, page_copies=batch.page_copies)
        return batch

    def _candidates(self) -> list[Req]:
        if self.config.policy == "lpm" and len(self.waiting) > 1:
            self.waiting.sort(key=lambda r: -self.cache.match_prefix(r.fill_ids, namespace=r.cache_namespace).num_tokens)
        return ([self.chunked] if self.chunked is not None else []) + self.waiting

    def schedule_prefill(self) -> Batch | None:
        cfg = self.config
        chunk_cap = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None
        budget, chosen, lens = cfg.max_prefill_tokens, [], []
        for req in self._candidates():
            if req is not self.chunked and self.num_running + len(chosen) >= cfg.max_running_requests:
                break
            if not self.can_hold_adapter(req):
                continue  # every LoRA slot serves other adapters' running requests: it waits for one
            if req.num_computed == 0 and req.prefix_node is None:
                self._match_prefix(req)
            remaining = req.seq_len - req.num_computed
            limit = budget if chunk_cap is None else min(budget, chunk_cap)
            if chunk_cap is None and not chosen:
                limit = remaining  # without chunking a prompt always fits in an empty batch
            take = min(remaining, limit)
            if take <= 0 or not self.grow(req, req.num_computed + take):
                if req is not self.chunked:
                    self._unmatch(req)  # don't pin its prefix while it waits
                break
            chosen.append(req)
            lens.append(take)
            self.hold_adapter(req)
            budget -= take
            if take < remaining:
                break  # this prompt continues in a later step
            if budget <= 0:
                break
        if not chosen:
            return None
        copies = []
        for req, n in zip(chosen, lens):
            if req is not self.chunked:
                self.waiting.remove(req)
            req.status = ReqStatus.PREFILLING
            if req.tail_copy is not None:
                copies.append(req.tail_copy)
                req.tail_copy = None
        return Batch(chosen, is_decode=False, extend_lens=lens, page_copies=copies)

    def _match_prefix(self, req: Req) -> None:
        # Leave at least one token to compute: its logits give the first output token.
        limit = req.seq_len - 1
        if req.first_logit_row is not None:  # prompt logprobs need the logits of those positions: compute them
            limit = min(limit, req.first_logit_row)
        match = self.cache.match_prefix(req.fill_ids, namespace=req.cache_namespace, max_tokens=limit)
        self.cache.lock(match.node)
        req.prefix_node = match.node
        req.pages = list(match.pages)
        req.num_cached_pages = len(match.pages)
        req.num_computed = len(match.pages) * self.page_size
        if match.tail is not None:
            self.cache.lock(match.tail)  # the page to copy must not be evicted to make room for the copy
            page = self.allocate(1)
            if page is None:
                self.cache.unlock(match.tail)
            else:
                req.pages.append(page[0])
                req.tail_copy, req.copy_source = (match.tail.page, page[0]), match.tail
                req.num_computed += match.tail_tokens
        if not req.output_ids:
            req.cached_tokens = req.num_computed

    def _release_copy_source(self, req: Req) -> None:
        if req.copy_source is not None:
            self.cache.unlock(req.copy_source)
            req.copy_source = None

    def _unmatch(self, req: Req) -> None:
        """Undo a prefix match for a request that could not be scheduled after all."""
        self.allocator.free(req.pages[req.num_cached_pages:])
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node, req.pages, req.num_cached_pages, req.num_computed = None, [], 0, 0
        req.tail_copy = None
        self._release_copy_source(req)

    def schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        # Every running request needs room for the KV of its newest token. The newest running requests make room
        # first; the last one left waits too when the pages are held elsewhere (a decode worker's reservations
        # for prompts on their way hold them until those prompts run).
        for req in list(self.running):
            while req in self.running and not self.grow(req, req.seq_len):
                if self._pages_for(req.seq_len) > self.allocator.num_pages:
                    raise PoolExhausted(
                        f"request {req.rid} needs {self._pages_for(req.seq_len)} KV pages but the pool has "
                        f"{self.allocator.num_pages}; raise --max-total-tokens", req)
                self.retract(self.running[-1])
        if not self.running:
            return None
        return Batch(list(self.running), is_decode=True, extend_lens=[1] * len(self.running))

    def retract(self, req: Req) -> None:
        """Requeue a running request, freeing its pages; it is recomputed from prompt + output later."""
        self.running.remove(req)
        self.release(req, cache=True)
        req.status = ReqStatus.WAITING
        self.waiting.insert(0, req)

    # ------------------------------------------------------------ removal
    def remove(self, req: Req, cache: bool = True) -> None:
        """Take a request out of whatever queue holds it and release its pages."""
        if req is self.chunked:
            self.chunked = None
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        for holder in self.holders:
            holder.discard(req)
        self.release(req, cache=cache)
        req.status = ReqStatus.FINISHED

    def flush_cache(self) -> bool:
        if self.live_reqs():
            return False
        pages = self.cache.flush()
        if pages is None:
            return False
        self.allocator.free(pages)
        return True

    def check_integrity(self) -> IntegrityReport:
        total = self.allocator.num_pages
        free = self.allocator.free_pages()
        cached = set(self.cache.pages())
        held: set[int] = set()
        problems = []
        for req in self.live_reqs():
            own = req.pages[req.num_cached_pages:]
            if not set(req.pages[:req.num_cached_pages]) <= cached:
                problems.append(f"{req.rid} reads cached pages that are not in the cache")
            if held & set(own):
                problems.append(f"{req.rid} shares owned pages with another request")
            held |= set(own)
        for holder in self.holders:
            for rid, pages in holder.held_pages().items():
                if held & set(pages):
                    problems.append(f"pages held for {rid} are also held by a request")
                held |= set(pages)
        for a, b, name in ((free, held, "free and held"), (free, cached, "free and cached"),
                           (held, cached, "held and cached")):
            if a & b:
                problems.append(f"pages both {name}: {sorted(a & b)[:8]}")
        if len(free) + len(held) + len(cached) != total:
            problems.append(f"free {len(free)} + held {len(held)} + cached {len(cached)} != total {total}")
        return IntegrityReport(not problems, total, len(free), len(held), len(cached), "; ".join(problems))
