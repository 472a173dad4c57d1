"""Cache events: a worker's radix cache names its pages as the routers do and records what each tier gains and
loses; the front's sum of them is what a router is told."""
from __future__ import annotations

from pdserve.shared.kv_events import DEVICE, HOST, STORAGE, CacheEvents, HeldPages, prefix_hashes
from pdserve.shared.radix_cache import RadixCache

PAGE = 4


def cache() -> tuple[RadixCache, CacheEvents]:
    c = RadixCache(PAGE)
    c.events = CacheEvents()
    return c, c.events


def test_inserted_full_pages_are_named_as_a_router_names_the_prompt():
    c, events = cache()
    tokens = list(range(100, 111))  # two full pages and a tail
    c.insert(tokens, [0, 1, 2], tail=True)
    _, cleared, added, removed = events.drain()
    assert cleared == [] and removed == {}
    assert added == {DEVICE: prefix_hashes(tokens, PAGE, 64)}  # the tail is not a page a router can name
    assert events.drain() is None  # nothing since
    # A prompt that shares the first page only: its first name is the same, its second is new.
    other = tokens[:PAGE] + [7] * PAGE
    c.insert(other, [0, 3])
    assert events.drain()[2] == {DEVICE: [prefix_hashes(other, PAGE, 64)[1]]}


def test_pages_under_a_namespace_are_not_told():
    c, events = cache()
    c.insert(list(range(8)), [0, 1], namespace="lora:a")
    assert events.drain() is None


def test_evicted_and_flushed_pages_are_told_and_a_page_counts_as_it_ended():
    c, events = cache()
    tokens = list(range(12))
    names = prefix_hashes(tokens, PAGE, 64)
    c.insert(tokens, [0, 1, 2])
    events.drain()
    assert sorted(c.evict(1)) == [2]  # the leaf goes
    assert events.drain()[3] == {DEVICE: [names[2]]}
    c.evict(1)
    c.insert(tokens, [5, 6, 7])  # evicted, then added again, within one iteration: held
    kind, cleared, added, removed = events.drain()
    assert names[1] in added[DEVICE] and DEVICE not in removed
    c.flush()
    assert events.drain() == ("kv", [DEVICE], {}, {})


def test_held_pages_add_up_and_bound_what_is_stored():
    held = HeldPages(storage_limit=3)
    held.apply([], {DEVICE: [1, 2], STORAGE: [10, 11]}, {})
    held.apply([], {STORAGE: [12, 13]}, {DEVICE: [1]})
    assert held.device == {2}
    assert list(held.storage) == [11, 12, 13]  # the oldest stored page is forgotten first
    held.apply([DEVICE], {DEVICE: [4]}, {})
    assert held.device == {4}
    held.apply([], {HOST: [2, 3]}, {DEVICE: [2]})  # evicted from the pool into host memory
    assert held.device == {4} and held.host == {2, 3}
    held.apply([HOST], {}, {})
    assert held.host == set() and list(held.storage) == [11, 12, 13]
