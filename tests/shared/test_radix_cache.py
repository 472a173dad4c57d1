"""Radix cache and page allocator: matching, sharing, locking and eviction at page granularity."""
from __future__ import annotations

import pytest

from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.radix_cache import RadixCache


def test_allocator_hands_out_contiguous_pages_and_refuses_double_free():
    alloc = PageAllocator(8)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(6) is None and alloc.num_free == 5  # all or nothing
    alloc.free([1])
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free([1])
    assert alloc.free_pages() == {1, 3, 4, 5, 6, 7}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_match_is_page_aligned_and_returns_the_inserted_pages(page_size):
    cache = RadixCache(page_size)
    tokens = list(range(100, 100 + 6 * page_size - 1))  # five full pages and a partial sixth
    result = cache.insert(tokens, [10, 11, 12, 13, 14, 15])
    assert result.pages == [10, 11, 12, 13, 14] and result.duplicates == []
    assert cache.num_pages == 5
    assert cache.match_prefix(tokens).pages == [10, 11, 12, 13, 14]
    # A prompt that diverges inside page 3 matches the first two pages only.
    other = tokens[: 2 * page_size] + [7] * (3 * page_size)
    assert cache.match_prefix(other).pages == [10, 11]
    assert cache.match_prefix(tokens, max_pages=3).pages == [10, 11, 12]


def test_insert_reports_duplicates_so_the_caller_frees_them():
    cache = RadixCache(2)
    cache.insert([1, 2, 3, 4], [0, 1])
    result = cache.insert([1, 2, 3, 4, 5, 6], [7, 8, 9])
    assert result.pages == [0, 1, 9]
    assert result.duplicates == [7, 8]
    assert sorted(cache.pages()) == [0, 1, 9]


def test_locked_paths_survive_eviction_and_lru_leaves_go_first():
    cache = RadixCache(1)
    a = cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([5, 6], [3, 4])
    cache.lock(a.node)
    freed = cache.evict(10)
    assert sorted(freed) == [3, 4]  # the unlocked branch only, leaf before parent
    assert cache.evictable_pages() == 0
    cache.unlock(a.node)
    assert cache.evict(1) == [2]  # the leaf of the locked path goes first once unlocked
    assert cache.num_pages == 2


def test_flush_refuses_while_locked():
    cache = RadixCache(2)
    r = cache.insert([1, 2, 3, 4], [0, 1])
    cache.lock(r.node)
    assert cache.flush() is None and cache.num_pages == 2
    cache.unlock(r.node)
    assert sorted(cache.flush()) == [0, 1] and cache.num_pages == 0
    with pytest.raises(RuntimeError):
        cache.unlock(r.node)
