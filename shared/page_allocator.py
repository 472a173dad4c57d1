"""PageAllocator: owns the set of free pages of one KV pool.

Pages are plain ints. A page is either free (here), held by a request, or held
by the radix cache; `check_integrity` in the scheduler proves the three add up.
"""
from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps runs contiguous.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` pages, or None (taking nothing) if fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
        # Keep descending order at the tail so the next allocation tends to be contiguous.
        self._free.extend(sorted(pages, reverse=True))

    def free_pages(self) -> set[int]:
        return set(self._free)
