"""RadixCache: a prefix tree of KV pages keyed by the tokens they hold.

Each node owns one page: its key is the tuple of the token ids in that page, its
path from the root is the token prefix before it. Inner nodes hold full pages
(`page_size` tokens). A leaf may also be a *tail*: the partly filled last page of
a finished sequence, keyed by the tokens it holds (fewer than `page_size`), so
that the next turn of a conversation, which extends that sequence, finds all of
it rather than its whole pages only.

A match is exact to the token: after its whole pages, the page (full or a tail)
whose leading tokens continue the prompt furthest lends those tokens too. Such a
page is shared by no one: the request takes a copy of it (the scheduler's
`page_copies`) and writes its own tokens on into the copy, past the ones it
shares, so a prompt that repeats a cached one, or leaves it inside a page,
computes only what it does not share. A namespace (a LoRA adapter's) is part
of the first page's key, so each namespace has its own subtree: KV computed
under one adapter never matches a prompt under another, or the base.

Invariants: a node with `lock_ref > 0` (some running request reads it, or a
descendant) is never evicted; only unlocked leaves are evicted, least recently
used first. Pages handed to `insert` are owned by the tree afterwards, except
the duplicates it returns, which the caller frees. The leaves are kept as the
tree changes (`_leaves`), so an eviction looks at the leaves alone, not at every
page: a full pool evicts on most steps, and a walk of the whole tree each time
was most of a fleet simulation's time.

With `events` (kv_events.CacheEvents), every full page outside a namespace is
named as the routers name it (`route_hash`) and its coming and going recorded.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.shared.kv_events import DEVICE, ROOT, CacheEvents, page_hash


@dataclass(eq=False)
class Node:
    key: tuple
    page: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    # The children's tokens, sorted, by namespace (on a first page; () elsewhere): the child sharing the most
    # leading tokens with a prompt sorts next to it, so a match looks at two keys where a root may hold thousands
    # of children, all starting with one token (a BOS or a chat template's first).
    heads: dict[tuple, list[tuple]] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = 0.0
    # The storage tier's (kv_tiers.py): the page's key there, once asked for, and whether it is stored.
    store_key: str | None = None
    stored: bool = False
    route_hash: int | None = None  # its name for the routers (kv_events.py); None in a namespace, or a tail


@dataclass
class PrefixMatch:
    pages: list[int]  # the full pages matched
    node: Node  # deepest matched node (the root when nothing matched)
    # With `max_tokens` only: the page after them (a tail or a full page) whose first `tail_tokens` tokens
    # continue the match; the request copies it rather than share it.
    tail: Node | None = None
    tail_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.pages)


@dataclass
class InsertResult:
    node: Node  # deepest node of the inserted path
    pages: list[int]  # the tree's pages for the inserted tokens, in order (a tail's last)
    duplicates: list[int]  # caller's pages whose tokens the tree already held: free them


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(key=(), page=-1, parent=None, lock_ref=1, route_hash=ROOT)
        self.events: CacheEvents | None = None
        self._num_pages = 0
        self._clock = itertools.count()
        self._leaves: dict[Node, None] = {}  # every childless node but the root, in the order they became leaves

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def page_keys(self, tokens: list[int], num_pages: int, namespace: str | None) -> list[tuple]:
        """The key of each of the first `num_pages` full pages of `tokens`."""
        s = self.page_size
        keys: list[tuple] = [tuple(tokens[i * s:(i + 1) * s]) for i in range(num_pages)]
        if namespace is not None and keys:
            keys[0] = (namespace, *keys[0])
        return keys

    def match_prefix(self, tokens: list[int], max_pages: int | None = None,
                     namespace: str | None = None, max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached page-aligned prefix of `tokens` (at most `max_pages` pages); with `max_tokens`, also the
        page after it that continues the match furthest, within `max_tokens` tokens in all."""
        s = self.page_size
        n = len(tokens) // s
        if max_pages is not None:
            n = min(n, max_pages)
        if max_tokens is not None:
            n = min(n, max_tokens // s)
        node, pages, now = self.root, [], time.monotonic()
        for key in self.page_keys(tokens, n, namespace):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            pages.append(child.page)
            node = child
        tail, length = None, 0
        if max_tokens is not None:
            start = len(pages) * s
            want = tokens[start:start + min(s - 1, max_tokens - start)]
            lead = (namespace,) if namespace is not None and not pages else ()
            tail, length = _furthest_child(node, lead, want)
            if tail is not None:
                tail.last_access = now
        return PrefixMatch(pages, node, tail, length)

    def insert(self, tokens: list[int], pages: list[int], namespace: str | None = None,
               tail: bool = False) -> InsertResult:
        """Add the full pages of `tokens` (backed by `pages`), and with `tail` the partly filled page after them
        as a tail; see InsertResult. Only a sequence that writes no more into that page may leave it as a tail."""
        n = min(len(tokens) // self.page_size, len(pages))
        keys = self.page_keys(tokens, n, namespace)
        rest = tokens[n * self.page_size:]
        if tail and 0 < len(rest) < self.page_size and len(pages) > n:
            keys.append((namespace, *rest) if namespace is not None and n == 0 else tuple(rest))
        node, path, duplicates, now = self.root, [], [], time.monotonic()
        for key, page in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key=key, page=page, parent=node)
                node.children[key] = child
                lead, toks = _split(key)
                bisect.insort(node.heads.setdefault(lead, []), toks)
                self._leaves.pop(node, None)
                self._leaves[child] = None
                self._num_pages += 1
                if self.events is not None and node.route_hash is not None and len(key) == self.page_size \
                        and not isinstance(key[0], str):
                    child.route_hash = page_hash(node.route_hash, key)
                    self.events.added(DEVICE, [child.route_hash])
            elif child.page != page:
                duplicates.append(page)
            child.last_access = now
            path.append(child.page)
            node = child
        return InsertResult(node, path, duplicates)

    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_pages: int, on_evict: Callable[[list[Node]], None] | None = None) -> list[int]:
        """Remove up to `num_pages` unlocked pages, least recently used leaves first; `on_evict` sees the nodes
        before their pages go (a lower tier keeps them)."""
        heap = [(n.last_access, next(self._clock), n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        gone: list[Node] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            gone.append(node)
            parent = node.parent
            del parent.children[node.key]
            lead, toks = _split(node.key)
            siblings = parent.heads[lead]
            del siblings[bisect.bisect_left(siblings, toks)]
            if not siblings:
                del parent.heads[lead]
            del self._leaves[node]
            self._num_pages -= 1
            freed.append(node.page)
            if parent is not self.root and not parent.children:
                self._leaves[parent] = None
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, next(self._clock), parent))
        if on_evict is not None and gone:
            on_evict(gone)
        if self.events is not None:
            self.events.removed(DEVICE, [n.route_hash for n in gone if n.route_hash is not None])
        return freed

    def evictable_pages(self) -> int:
        return sum(1 for n in self._nodes() if n.lock_ref == 0)

    def flush(self) -> list[int] | None:
        """Drop every page if nothing is locked; None (and no change) otherwise."""
        if any(n.lock_ref for n in self._nodes()):
            return None
        pages = [n.page for n in self._nodes()]
        self.root.children.clear()
        self.root.heads.clear()
        self._leaves.clear()
        self._num_pages = 0
        if self.events is not None:
            self.events.cleared(DEVICE)
        return pages

    def pages(self) -> list[int]:
        return [n.page for n in self._nodes()]

    def nodes(self):
        """Every node but the root."""
        return self._nodes()

    def path(self, node: Node) -> list[Node]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node is not self.root and node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node


def _split(key: tuple) -> tuple[tuple, tuple]:
    """(the namespace, as a 1-tuple, or (); the tokens) of a key."""
    return (key[:1], key[1:]) if key and isinstance(key[0], str) else ((), key)


def _furthest_child(node: Node, lead: tuple, want: list[int]) -> tuple[Node | None, int]:
    """The child of `node` whose key, after `lead` (the namespace, on the first page), starts with the most of
    `want`, and how many; (None, 0) when none starts with its first token. In sorted order the keys sharing
    the most with `want` sit on either side of where it would go."""
    keys = node.heads.get(lead)
    if not keys or not want:
        return None, 0
    query = tuple(want)
    at = bisect.bisect_left(keys, query)
    best, most = None, 0
    for key in keys[max(at - 1, 0):at + 1]:
        n = 0
        for a, b in zip(key, query):
            if a != b:
                break
            n += 1
        if n > most:
            best, most = key, n
    return (node.children[lead + best], most) if best is not None else (None, 0)
