"""What a prompt's span says of its cached tokens (services/worker/front/spans.py): how many, and from which tier of the
cache each came, so that a trace tells a device hit from a prefix read back from host memory or storage."""
from __future__ import annotations

from pdserve.services.worker.front.spans import ReqTrace, prompt_attributes


def trace(prompt_tokens: int, cached: int, tier_tokens: dict) -> ReqTrace:
    return ReqTrace(arrival=0.0, first_scheduled=0.1, first_token_time=0.2, pages_reserved=None,
                    prompt_tokens=prompt_tokens, cached_tokens=cached, output_tokens=4, pages=8,
                    prefill_chunks=[(0.1, 0.2, prompt_tokens - cached)], decode_steps=3, drafted_tokens=0,
                    accepted_tokens=0, finish_reason="length", dst_pages=0, tier_tokens=tier_tokens)


def test_cached_tokens_are_told_by_tier_and_the_lowest_tier_names_the_hit():
    mixed = prompt_attributes(trace(130, 100, {"host": 32, "storage": 48}), 100)
    assert mixed["pdserve.tokens_computed"] == 30 and mixed["pdserve.cached_tokens"] == 100
    assert (mixed["pdserve.cached_tokens.device"], mixed["pdserve.cached_tokens.host"],
            mixed["pdserve.cached_tokens.storage"]) == (20, 32, 48)
    assert mixed["pdserve.cache_tier"] == "storage"
    device = prompt_attributes(trace(130, 64, {}), 64)
    assert device["pdserve.cache_tier"] == "device" and "pdserve.cached_tokens.host" not in device
    assert "pdserve.cache_tier" not in prompt_attributes(trace(130, 0, {}), 0)
