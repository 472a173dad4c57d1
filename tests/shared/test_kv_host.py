"""The host-memory tier under the radix cache (shared/kv_host.py, kv_tiers.py): what the pool evicts comes back
with the same tokens as computing it, above the storage tier or alone; a full tier lets the least recently used
go and tells the routers; a flush forgets it. A GPU worker runs it on pinned memory (benchmarks/gpu_tiers.py
measures the copies there); the engine here is the CPU one, which runs the same code on plain host memory."""
from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from pdserve.services.worker.engine.tier_metrics import TierMetrics
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig, TierConfig
from pdserve.shared.engine import Engine
from pdserve.shared.kv_events import DEVICE, HOST, CacheEvents, prefix_hashes
from pdserve.shared.kv_host import HostPages, copy_pages
from pdserve.shared.kv_pool import KVLayout, KVPool
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.services.worker.engine.engine_calls import trace_of
from pdserve.services.worker.front.spans import ReqTrace, prompt_attributes
from pdserve.shared.kv_tiers import host_pages
from test_kv_tiers import PAGE, PROMPT, engine_for, run, settle, stored_files

OTHERS = {f"b{k}": [(k * 13 + i * 7) % 400 + 50 for i in range(41)] for k in range(8)}


def host_engine(model, pages: int = 24, ratio: float = 4.0, storage=None, policy: str = "write_through",
                **config) -> Engine:
    tiers = TierConfig(str(storage) if storage is not None else None, policy, host_ratio=ratio)
    config = {"dtype": "float32", **config}
    return Engine(RuntimeConfig(model_path=str(model), cache=CacheConfig(page_size=PAGE, max_total_tokens=PAGE * pages),
                                scheduler=SchedulerConfig(max_prefill_tokens=256), tiers=tiers, **config))


def evict_prompt(engine) -> None:
    """Run other prompts until the pool holds none of PROMPT's pages (looked at once: a look is a use)."""
    for rid, ids in OTHERS.items():
        run(engine, {rid: ids})
    assert engine.cache.match_prefix(PROMPT).num_tokens == 0


# ---------------------------------------------------------------- the pages
def test_copies_move_every_page_to_its_place_in_runs_or_scattered():
    src = torch.arange(40 * 6, dtype=torch.float32).view(40, 2, 3)
    rng = random.Random(7)
    cases = (([3, 4, 5, 9], [10, 11, 12, 0]), (rng.sample(range(40), 25), rng.sample(range(40), 25)),
             (list(range(5, 25)), list(range(20, 40))))
    for dst_pages, src_pages in cases:
        dst = torch.zeros(40, 2, 3)
        copy_pages(dst, dst_pages, src, src_pages)
        for d, s in zip(dst_pages, src_pages):
            assert torch.equal(dst[d], src[s])
        untouched = [p for p in range(40) if p not in dst_pages]
        assert not dst[untouched].any()


def test_the_least_recently_used_page_leaves_first_but_never_one_being_written():
    pool = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
    host = HostPages(3, (4,), torch.float32, torch.device("cpu"))
    slots, left = host.keep(["a", "b", "c"], [1, 2, 3], pool, [0, 1, 2])
    assert left == [] and host.used == 3 and torch.equal(host.buffer[slots[1]], pool[1])
    assert host.find(["a", "b", "x"]) == slots[:2]  # a and b used again: c is the least recent
    host.lend([slots[2]])  # c is being written to storage: it stays
    new, left = host.keep(["d"], [4], pool, [5])
    assert left == [1] and host.find(["a"]) == [] and torch.equal(host.buffer[new[0]], pool[5])
    host.clear()
    assert host.used == 0 and host.find(["b"]) == []
    taken, _ = host.keep(["e", "f", "g"], [None] * 3, pool, [1, 2, 3])
    assert taken[2] is None and host.counts.dropped == 1  # c's slot is still lent
    host.give_back([slots[2]])
    assert host.keep(["g"], [None], pool, [3])[0] == [slots[2]]


def test_a_host_tier_the_machine_cannot_hold_or_smaller_than_the_pool_is_a_start_error():
    pool = KVPool(KVLayout(num_pages=64, page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32))
    assert host_pages(TierConfig(host_ratio=2.0), pool) == 128
    with pytest.raises(ValueError, match=r"--hicache-size 1e\+06: the host tier would take 1000000\.0 GB of host "
                                         r"memory, and the machine has [0-9.]+ GB available \(at most 90% of it\)"):
        host_pages(TierConfig(host_gb=1e6), pool)
    with pytest.raises(ValueError, match="--hicache-size 1e-06: the host tier would hold 0 pages, fewer than the "
                                         "pool's 64"):
        host_pages(TierConfig(host_gb=1e-6), pool)
    with pytest.raises(ValueError, match="--hicache-ratio must be >= 1"):
        TierConfig(host_ratio=0.5)


# ---------------------------------------------------------------- the engine
@pytest.mark.parametrize("arithmetic", [{}, {"dtype": "bfloat16", "deterministic": True}], ids=["fp32", "det-bf16"])
def test_what_the_pool_evicts_comes_back_from_host_memory_with_the_same_tokens(tiny_models, arithmetic):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None, pages=24, **arithmetic), {"a": PROMPT})
    engine = host_engine(model, **arithmetic)
    assert run(engine, {"a": PROMPT}) == plain
    evict_prompt(engine)
    req = Req(rid="a2", input_ids=list(PROMPT), params=SamplingParams(temperature=0, max_new_tokens=6))
    tokens, cached = run(engine, {"a2": PROMPT}, reqs=[req])["a2"]
    assert tokens == plain["a"][0] and cached == 40  # usage counts the tokens the host tier gave back
    assert req.tier_tokens == {"host": 40}  # and the request knows which tier they came from (its trace says)
    assert prompt_attributes(ReqTrace(**trace_of(req)), cached)["pdserve.cache_tier"] == "host"
    stats = engine.tiers.stats()
    assert stats["host_hits"] == 1 and stats["host_hit_tokens"] > 0
    assert stats["host_bytes_read"] == stats["host_hit_tokens"] // PAGE * engine.tiers.host.page_bytes
    assert "storage_pages" not in stats and engine.tiers.files is None
    metrics = TierMetrics(registry := CollectorRegistry(), "m", PAGE, host=True, storage=False)
    metrics.refresh(stats)
    assert registry.get_sample_value("pdserve_worker_kv_host_hit_tokens_total", {"model_name": "m"}) == \
        stats["host_hit_tokens"]
    assert registry.get_sample_value("pdserve_worker_kv_host_pages", {"model_name": "m"}) == stats["host_pages"] > 0


def test_above_storage_write_back_writes_from_the_host_copies(tiny_models, tmp_path):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None, pages=24), {"a": PROMPT})
    # a pool of 48 pages: each eviction (at most a prompt's 12 pages) fits the writer's quarter of the pool
    engine = host_engine(model, pages=48, storage=tmp_path, policy="write_back")
    # No eviction dropped for the writer being behind (a quarter of the pool waiting: counted, not a fault, and
    # on a busy machine the writer thread can be that far behind between two evictions).
    engine.tiers.writer.limit_pages = 1 << 20
    run(engine, {"a": PROMPT})
    assert not stored_files(tmp_path)
    evict_prompt(engine)
    settle(engine)
    assert len(stored_files(tmp_path)) >= 10 and not engine.tiers.host._busy  # every lent slot given back
    stats = engine.tiers.stats()
    assert stats["pages_written"] == stats["host_bytes_written"] // engine.tiers.host.page_bytes > 0
    assert stats["writes_dropped"] == 0
    cold = engine_for(model, tmp_path)  # another worker on the directory, with no host tier
    tokens, cached = run(cold, {"a": PROMPT})["a"]
    assert tokens == plain["a"][0] and cached == 40


def test_a_full_host_tier_lets_the_oldest_go_and_tells_the_routers(tiny_models):
    model = tiny_models["llama"]
    engine = host_engine(model, ratio=1.0)  # 24 slots: two prompts' pages
    engine.cache.events = engine.tiers.events = CacheEvents()
    names = prefix_hashes(PROMPT, PAGE, 10)
    run(engine, {"a": PROMPT})
    for rid in ("b0", "b1"):  # a pool of 24 pages holds two prompts: the second evicts a's into host memory
        run(engine, {rid: OTHERS[rid]})
    _, _, added, removed = engine.tiers.events.drain()
    assert set(names) <= set(added[HOST]) and set(names) <= set(removed[DEVICE])
    for k in range(4):  # more prompts than the host tier holds
        run(engine, {f"c{k}": [(k * 29 + i * 5) % 300 + 100 for i in range(41)]})
    _, _, _, removed = engine.tiers.events.drain()
    assert set(names) <= set(removed[HOST]) and engine.tiers.host.used <= 24
    assert run(engine, {"a2": PROMPT})["a2"][1] == 0  # gone from every tier: computed again


def test_a_flush_forgets_host_memory_unless_only_storage_is_named(tiny_models):
    model = tiny_models["llama"]
    engine = host_engine(model)
    engine.cache.events = engine.tiers.events = CacheEvents()
    run(engine, {"a": PROMPT})
    evict_prompt(engine)
    assert engine.flush_cache(lower=("storage",))
    assert run(engine, {"a2": PROMPT})["a2"][1] == 40  # the host tier kept it
    engine.tiers.events.drain()
    assert engine.flush_cache()
    assert engine.tiers.events.drain()[1] == [DEVICE, HOST] and engine.tiers.host.used == 0
    assert run(engine, {"a3": PROMPT})["a3"][1] == 0
