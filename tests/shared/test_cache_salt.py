"""A cache_salt namespaces a prompt's KV in the radix cache and in the keys of every tier below it: pages computed
under one salt are found only under the same salt, and the salt itself appears in no key or namespace."""
from __future__ import annotations

from pdserve.shared.kv_keys import chain_keys
from pdserve.shared.radix_cache import RadixCache
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

PAGE = 4
PROMPT = list(range(100, 117))  # four full pages and a tail
IDENTITY = "00" * 16


def req(salt: str | None) -> Req:
    return Req("r", list(PROMPT), SamplingParams(cache_salt=salt))


def test_the_radix_cache_finds_a_salted_prompt_only_under_its_salt():
    cache = RadixCache(PAGE)
    cache.insert(PROMPT, list(range(4)), req("tenant-a").cache_namespace)
    for salt, found in (("tenant-a", 4), ("tenant-b", 0), (None, 0)):
        assert len(cache.match_prefix(PROMPT, namespace=req(salt).cache_namespace).pages) == found, salt
    cache.insert(PROMPT, list(range(4, 8)))  # unsalted: a salt still sees only its own
    assert not cache.match_prefix(PROMPT, namespace=req("tenant-b").cache_namespace).pages


def test_the_tiers_keys_differ_by_salt_and_hold_no_salt():
    cache = RadixCache(PAGE)
    keys = {salt: chain_keys(IDENTITY, cache.page_keys(PROMPT, 4, req(salt).cache_namespace))
            for salt in ("tenant-a", "tenant-b", None)}
    assert len({k[0] for k in keys.values()}) == 3 and len({k[3] for k in keys.values()}) == 3
    assert keys["tenant-a"] == chain_keys(IDENTITY, cache.page_keys(PROMPT, 4, req("tenant-a").cache_namespace))
    namespace = req("tenant-a").cache_namespace
    assert "tenant-a" not in namespace and namespace.startswith("salt:")
