"""Radix cache and page allocator: matching, sharing, locking and eviction at page granularity, the tails
finished sequences leave, and matches exact to the token through the page a prompt leaves part-way."""
from __future__ import annotations

import random

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


def test_a_finished_sequence_leaves_its_partial_page_as_a_tail_that_its_continuation_matches():
    cache = RadixCache(4)
    turn = [1, 2, 3, 4, 5, 6, 7]  # a page and 3 tokens of the next
    result = cache.insert(turn, [10, 11], tail=True)
    assert result.pages == [10, 11] and cache.num_pages == 2
    following = turn + [8, 9, 20, 21]
    match = cache.match_prefix(following, max_tokens=len(following) - 1)
    assert match.pages == [10] and match.tail.page == 11 and match.tail_tokens == 3
    # Within max_tokens, the tail lends what it shares; never without max_tokens (whole pages only).
    short = cache.match_prefix(following, max_tokens=6)
    assert short.tail.page == 11 and short.tail_tokens == 2
    assert cache.match_prefix(following).tail is None
    # A prompt that diverges inside the tail's tokens shares the tokens before it.
    diverging = cache.match_prefix([1, 2, 3, 4, 5, 9, 9], max_tokens=6)
    assert diverging.tail.page == 11 and diverging.tail_tokens == 1
    assert cache.match_prefix([1, 2, 3, 4, 9, 9, 9], max_tokens=6).tail is None  # shares no token of it
    # Without `tail` an insert keeps whole pages only, as before.
    plain = RadixCache(4)
    assert plain.insert(turn, [10, 11]).pages == [10] and plain.num_pages == 1


def test_the_longest_tail_within_the_limit_wins_and_a_tail_never_takes_children():
    cache = RadixCache(4)
    cache.insert([1, 2, 3, 4, 5], [0, 1], tail=True)
    cache.insert([1, 2, 3, 4, 5, 6, 7], [0, 2], tail=True)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cache.match_prefix(tokens, max_tokens=8).tail.page == 2
    at_most_2 = cache.match_prefix(tokens, max_tokens=6)  # 2 tokens after the page at most: either lends 1 or 2
    assert at_most_2.tail.page == 2 and at_most_2.tail_tokens == 2
    # A longer sequence over the same tokens adds a full page beside the tails.
    result = cache.insert(tokens, [0, 3, 4])
    assert result.pages == [0, 3] and cache.match_prefix(tokens, max_tokens=8).pages == [0, 3]
    assert sorted(cache.pages()) == [0, 1, 2, 3]


def test_tails_are_per_namespace_deduplicated_and_evicted_like_leaves():
    cache = RadixCache(4)
    assert cache.insert([1, 2], [5], namespace="a", tail=True).pages == [5]
    assert cache.match_prefix([1, 2, 3], max_tokens=2).tail is None  # the base model's prompt
    assert cache.match_prefix([1, 2, 3], namespace="a", max_tokens=2).tail.page == 5
    again = cache.insert([1, 2], [6], namespace="a", tail=True)
    assert again.pages == [5] and again.duplicates == [6]
    assert cache.evict(1) == [5] and cache.num_pages == 0


def test_a_prompt_that_leaves_a_full_page_part_way_matches_to_the_token():
    cache = RadixCache(4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [0, 1])
    cache.insert([1, 2, 3, 4, 5, 6, 9, 9], [0, 2])
    same = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=7)  # the same prompt: all but its last token
    assert same.pages == [0] and same.tail.page == 1 and same.tail_tokens == 3
    apart = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0, 0], max_tokens=8)  # both pages share 2: either will do
    assert apart.pages == [0] and apart.tail.page in (1, 2) and apart.tail_tokens == 2
    # The first page too, and only within its namespace.
    assert cache.match_prefix([1, 2, 7], max_tokens=2).tail_tokens == 2
    assert cache.match_prefix([1, 2, 7], max_tokens=2, namespace="a").tail is None
    cache.insert([1, 2, 3, 4], [3], namespace="a")
    salted = cache.match_prefix([1, 2, 7], max_tokens=2, namespace="a")
    assert salted.tail.page == 3 and salted.tail_tokens == 2
    # An evicted or flushed page lends nothing any more.
    assert sorted(cache.evict(4)) == [0, 1, 2, 3]
    assert cache.match_prefix([1, 2, 7], max_tokens=2).tail is None
    cache.insert([1, 2, 3, 4], [5])
    assert cache.flush() == [5] and cache.match_prefix([1, 2, 7], max_tokens=2).tail is None


def test_eviction_after_random_inserts_locks_and_evictions_takes_the_lru_unlocked_leaves():
    """The tree keeps its leaves as it changes; what an eviction takes is what a walk of the whole tree would
    pick: the least recently used unlocked leaves, then parents that became leaves."""
    import random
    rng = random.Random(7)
    cache, next_page, locked = RadixCache(2), iter(range(1_000_000)), []
    for _ in range(300):
        action = rng.random()
        if action < 0.6:
            tokens = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))]
            result = cache.insert(tokens, [next(next_page) for _ in range(len(tokens) // 2)])
            if rng.random() < 0.2:
                cache.lock(result.node)
                locked.append(result.node)
        elif action < 0.7 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            leaves = {n for n in cache.nodes() if not n.children}
            unlocked = [n for n in leaves if n.lock_ref == 0]
            oldest = min((n.last_access for n in unlocked), default=None)
            freed = cache.evict(1)
            assert freed == [] if oldest is None else freed[0] in {n.page for n in unlocked if n.last_access == oldest}
    evictable = cache.evictable_pages()
    assert len(cache.evict(10**6)) == evictable
    assert all(n.lock_ref > 0 for n in cache.nodes())


def test_the_page_sharing_most_is_found_among_many_that_start_alike():
    # Every prompt starts with one token (a BOS): the match must still find the page sharing the most, as a
    # comparison with every page would.
    rng = random.Random(5)
    cache = RadixCache(8)
    pages = [[1] + [rng.randrange(4) for _ in range(7)] for _ in range(300)]
    for i, page in enumerate(pages):
        cache.insert(page, [i])
    for _ in range(200):
        prompt = [1] + [rng.randrange(4) for _ in range(9)]
        match = cache.match_prefix(prompt, max_tokens=7)
        def shared(key):
            return next((n for n, (a, b) in enumerate(zip(key, prompt[:7])) if a != b), min(len(key), 7))
        most = max(shared(cache_key) for cache_key in {tuple(p) for p in pages})
        assert match.tail_tokens == most and shared(match.tail.key) == most
