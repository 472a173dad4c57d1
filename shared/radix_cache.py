"""RadixCache: a prefix tree of KV pages keyed by the tokens they hold.

Each node owns exactly one full page: its key is the tuple of `page_size` token
ids in that page, its path from the root is the token prefix before it. The tree
only ever holds full pages, so a match is always page-aligned. A namespace (a LoRA
adapter's) is part of the first page's key, so each namespace has its own subtree:
KV computed under one adapter never matches a prompt under another, or the base.

Invariants: a node with `lock_ref > 0` (some running request reads it, or a
descendant) is never evicted; only unlocked leaves are evicted, least recently
used first. Pages handed to `insert` are owned by the tree afterwards, except
the duplicates it returns, which the caller frees.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: tuple
    page: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = 0.0


@dataclass
class PrefixMatch:
    pages: list[int]
    node: Node  # deepest matched node (the root when nothing matched)

    @property
    def num_tokens(self) -> int:
        return len(self.pages)


@dataclass
class InsertResult:
    node: Node  # deepest node of the inserted path
    pages: list[int]  # the tree's pages for the inserted tokens, in order
    duplicates: list[int]  # caller's pages whose tokens the tree already held: free them


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(key=(), page=-1, parent=None, lock_ref=1)
        self._num_pages = 0
        self._clock = itertools.count()

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def _keys(self, tokens: list[int], num_pages: int, namespace: str | None) -> list[tuple]:
        s = self.page_size
        keys: list[tuple] = [tuple(tokens[i * s:(i + 1) * s]) for i in range(num_pages)]
        if namespace is not None and keys:
            keys[0] = (namespace, *keys[0])
        return keys

    def match_prefix(self, tokens: list[int], max_pages: int | None = None,
                     namespace: str | None = None) -> PrefixMatch:
        """Longest cached page-aligned prefix of `tokens` (at most `max_pages` pages)."""
        n = len(tokens) // self.page_size
        if max_pages is not None:
            n = min(n, max_pages)
        node, pages, now = self.root, [], time.monotonic()
        for key in self._keys(tokens, n, namespace):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            pages.append(child.page)
            node = child
        return PrefixMatch(pages, node)

    def insert(self, tokens: list[int], pages: list[int], namespace: str | None = None) -> InsertResult:
        """Add the full pages of `tokens` (backed by `pages`); see InsertResult."""
        n = min(len(tokens) // self.page_size, len(pages))
        node, path, duplicates, now = self.root, [], [], time.monotonic()
        for key, page in zip(self._keys(tokens, n, namespace), pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key=key, page=page, parent=node)
                node.children[key] = child
                self._num_pages += 1
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

    def evict(self, num_pages: int) -> list[int]:
        """Remove up to `num_pages` unlocked pages, least recently used leaves first."""
        heap = [(n.last_access, next(self._clock), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self._num_pages -= 1
            freed.append(node.page)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(self._clock), parent))
        return freed

    def evictable_pages(self) -> int:
        return sum(1 for n in self._nodes() if n.lock_ref == 0)

    def flush(self) -> list[int] | None:
        """Drop every page if nothing is locked; None (and no change) otherwise."""
        if any(n.lock_ref for n in self._nodes()):
            return None
        pages = [n.page for n in self._nodes()]
        self.root.children.clear()
        self._num_pages = 0
        return pages

    def pages(self) -> list[int]:
        return [n.page for n in self._nodes()]

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _leaves(self):
        return (n for n in self._nodes() if not n.children)
