"""Routing policies over a pool of workers whose health and load are set by hand (no processes)."""
from __future__ import annotations

import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.workers.router import NoWorker, Router
from pdserve.services.gateway.workers.pool import Worker, WorkerPool

PAGE = 16


def make_pool(mode: str, counts: dict[str, int]) -> WorkerPool:
    specs = {role: [f"10.0.0.{i}:{5000 + n}" for n in range(c)] for i, (role, c) in enumerate(counts.items())}
    pool = WorkerPool(specs)
    for role, addresses in specs.items():
        for address in addresses:
            pool.workers[address] = Worker(address, role, None, None, healthy=True,
                                           info=pb.InfoReply(compat=pb.Compat(page_size=PAGE), max_running_requests=8),
                                           load=pb.LoadReply(free_pages=100, total_pages=100))
    assert pool.mode == mode
    return pool


def prompt(seed: int, pages: int = 4) -> list[int]:
    return [seed * 1000 + i for i in range(pages * PAGE + 3)]


def test_cache_aware_sends_a_shared_prefix_back_to_the_same_worker():
    pool = make_pool("colocated", {"colocated": 3})
    router = Router(pool)
    first = router.choose(prompt(1)).generate
    first.in_flight += 1  # it is now the busiest, but only slightly
    again = router.choose(prompt(1)[:2 * PAGE] + [7] * 40).generate  # same first two pages, different tail
    assert again is first
    other = router.choose(prompt(2)).generate  # an unrelated prompt goes to a less loaded worker
    assert other is not first


def test_cache_aware_gives_up_affinity_when_the_owner_is_overloaded():
    pool = make_pool("colocated", {"colocated": 2})
    router = Router(pool, balance_abs=2, balance_rel=1.5)
    owner = router.choose(prompt(1)).generate
    owner.in_flight = 10
    assert router.choose(prompt(1)).generate is not owner


def test_short_prompts_without_a_full_page_go_by_load():
    pool = make_pool("colocated", {"colocated": 2})
    router = Router(pool)
    a = router.choose([1, 2, 3]).generate
    a.in_flight += 1
    assert router.choose([1, 2, 3]).generate is not a


def test_pd_pairs_prefill_by_affinity_and_decode_by_load_and_free_pages():
    pool = make_pool("pd", {"prefill": 2, "decode": 3})
    router = Router(pool)
    decodes = pool.of_role("decode")
    decodes[0].in_flight = 3
    decodes[1].load = pb.LoadReply(free_pages=10, total_pages=100)
    decodes[2].load = pb.LoadReply(free_pages=90, total_pages=100)
    pair = router.choose(prompt(1))
    assert pair.prefill.role == "prefill"
    assert pair.generate is decodes[2]  # idle, and the most free pages
    assert router.choose(prompt(1)).prefill is pair.prefill
    # A decode worker whose free pages cannot hold the prompt is the last resort.
    decodes[2].load = pb.LoadReply(free_pages=2, total_pages=100)
    assert router.choose(prompt(3, pages=8)).generate is decodes[1]


def test_pd_sends_a_conversations_next_turn_to_the_decode_worker_that_holds_it():
    # The decode worker keeps the KV of what it decoded (prompt and output): the next turn, whose prompt starts
    # with that conversation, goes back to it, unless it is clearly busier or has no room for the prompt.
    pool = make_pool("pd", {"prefill": 2, "decode": 3})
    router = Router(pool, balance_abs=2, balance_rel=1.5)
    turn = prompt(1)
    holder = router.choose(turn).generate
    holder.in_flight = 2  # busier than the others, but not clearly
    turn = turn + [9] * 40
    assert router.choose(turn).generate is holder
    holder.in_flight = 10
    assert router.choose(turn + [8] * 40).generate is not holder
    holder.in_flight = 0
    holder.load = pb.LoadReply(free_pages=1, total_pages=100)
    assert router.choose(turn + [7] * 40).generate is not holder


def test_round_robin_cycles_over_healthy_workers_only():
    pool = make_pool("colocated", {"colocated": 3})
    router = Router(pool, "round_robin")
    ws = pool.of_role("colocated")
    ws[1].healthy = False
    picks = [router.choose(prompt(1)).generate.address for _ in range(4)]
    assert picks == [ws[0].address, ws[2].address] * 2


def test_excluded_and_unhealthy_workers_are_never_chosen():
    pool = make_pool("pd", {"prefill": 2, "decode": 2})
    router = Router(pool)
    p0, p1 = pool.of_role("prefill")
    d0, d1 = pool.of_role("decode")
    pair = router.choose(prompt(1), exclude=frozenset({p0.address, d0.address}))
    assert (pair.prefill, pair.generate) == (p1, d1)
    d1.healthy = False
    with pytest.raises(NoWorker, match="decode"):
        router.choose(prompt(1), exclude=frozenset({d0.address}))


def test_forget_drops_affinity_after_a_cache_flush():
    pool = make_pool("colocated", {"colocated": 2})
    router = Router(pool)
    owner = router.choose(prompt(1)).generate
    router.forget(owner.address)
    assert owner.address not in router.prefixes.values()


class ServingStub:
    """A worker's gRPC stub that answers every health check (a unit test of the pool's logic above it)."""

    async def Health(self, request, timeout, wait_for_ready=False):
        return pb.HealthReply(ok=True)

    async def Info(self, request, timeout):
        return pb.InfoReply(compat=pb.Compat(page_size=PAGE), max_running_requests=8)

    async def Load(self, request, timeout):
        return pb.LoadReply(free_pages=100, total_pages=100)


async def test_a_worker_back_after_a_failure_loses_its_prefix_affinity():
    """It may have restarted with an empty cache: its prompts go by load again instead of to a cold worker."""
    pool = make_pool("colocated", {"colocated": 2})
    router = Router(pool)
    owner = router.choose(prompt(1)).generate
    owner.in_flight += 1  # slightly busier: only affinity would send the prompt back to it
    assert router.choose(prompt(1)).generate is owner
    owner.stub = ServingStub()
    pool.take_out(owner, "connection refused")
    assert await pool.check(owner) and owner.healthy
    assert owner.address not in router.prefixes.values()
    assert router.choose(prompt(1)).generate is not owner


def test_pool_refuses_incomplete_or_mixed_worker_lists():
    with pytest.raises(ValueError, match="--prefill and --decode"):
        WorkerPool({"prefill": ["a:1"]})
    with pytest.raises(ValueError, match="not both"):
        WorkerPool({"colocated": ["a:1"], "decode": ["b:2"]})


async def test_dns_names_expand_to_every_address_and_follow_changes(monkeypatch):
    answers = {"decode.svc:50052": ["10.1.0.1:50052", "10.1.0.2:50052"], "prefill.svc:50051": ["10.2.0.1:50051"]}
    monkeypatch.setattr("pdserve.services.gateway.workers.pool.expand_hostports", lambda spec: answers[spec])
    pool = WorkerPool({"prefill": ["prefill.svc:50051"], "decode": ["decode.svc:50052"]})
    try:
        await pool._resolve()
        assert sorted(w.address for w in pool.of_role("decode")) == ["10.1.0.1:50052", "10.1.0.2:50052"]
        busy = pool.workers["10.1.0.1:50052"]
        busy.in_flight = 1
        answers["decode.svc:50052"] = ["10.1.0.3:50052"]  # a scale-down and a new pod
        await pool._resolve()
        # The new pod joins; the idle vanished one goes; the one with requests stays until they finish.
        assert sorted(w.address for w in pool.of_role("decode")) == ["10.1.0.1:50052", "10.1.0.3:50052"]
        busy.in_flight = 0
        await pool._resolve()
        assert [w.address for w in pool.of_role("decode")] == ["10.1.0.3:50052"]
        assert [w.address for w in pool.of_role("prefill")] == ["10.2.0.1:50051"]
    finally:
        await pool.close()


def events(snapshot=False, cleared=(), device=(), gone=(), stored=(), domain="", host=(), host_gone=()):
    return pb.KVEventBatch(snapshot=snapshot, cleared=list(cleared), device_added=list(device),
                           device_removed=list(gone), storage_added=list(stored), storage_domain=domain,
                           host_added=list(host), host_removed=list(host_gone))


def test_a_prefix_a_worker_says_it_holds_goes_to_it_without_any_history():
    pool = make_pool("colocated", {"colocated": 3})
    router = Router(pool)
    holder = pool.of_role("colocated")[1]
    p = prompt(5)
    router.learn(holder.address, events(snapshot=True, device=router._prefix_hashes(p, PAGE)[:3]))
    pair = router.choose(p)
    assert pair.generate is holder and pair.why == "holds the prompt's first 3 pages"
    # Once it says the pages are gone, neither its events nor the history of this routing keep the prompt there.
    router.learn(holder.address, events(gone=router._prefix_hashes(p, PAGE)))
    holder.in_flight = 1
    assert router.choose(p).generate is not holder


def test_device_beats_storage_of_the_same_length_and_a_longer_stored_prefix_beats_a_short_device_one():
    pool = make_pool("colocated", {"colocated": 3})
    router = Router(pool)
    a, b, c = pool.of_role("colocated")
    p = prompt(6, pages=8)
    names = router._prefix_hashes(p, PAGE)
    router.learn(a.address, events(snapshot=True, device=names[:4]))
    router.learn(b.address, events(snapshot=True, stored=names[:4], domain="dir-1"))
    assert router.choose(p).generate is a  # (which also makes a the prompt's holder in this router's history)
    router = Router(pool)
    router.learn(a.address, events(snapshot=True, device=names[:4]))
    router.learn(b.address, events(snapshot=True, stored=names[:8], domain="dir-1"))
    pair = router.choose(p)
    assert pair.generate is b and pair.why == "holds the prompt's first 8 pages in storage"
    # A worker sharing b's storage domain reads the same pages: as good, so the least loaded of the two.
    router = Router(pool)
    router.learn(b.address, events(snapshot=True, stored=names[:8], domain="dir-1"))
    router.learn(c.address, events(snapshot=True, domain="dir-1"))
    b.in_flight = 1
    assert router.choose(p).generate is c


def test_device_beats_host_memory_which_beats_storage_and_a_prefix_may_span_device_and_host():
    pool = make_pool("colocated", {"colocated": 3})
    a, b, c = pool.of_role("colocated")
    p = prompt(6, pages=8)
    router = Router(pool)
    names = router._prefix_hashes(p, PAGE)
    router.learn(a.address, events(snapshot=True, device=names[:6]))
    router.learn(b.address, events(snapshot=True, host=names[:6]))
    router.learn(c.address, events(snapshot=True, stored=names[:6], domain="dir-1"))
    assert router.choose(p).generate is a
    router = Router(pool)
    router.learn(b.address, events(snapshot=True, host=names[:6]))
    router.learn(c.address, events(snapshot=True, stored=names[:6], domain="dir-1"))
    pair = router.choose(p)
    assert pair.generate is b and pair.why == "holds the prompt's first 6 pages in host memory"
    # The pool evicted the prefix's last pages into host memory, and storage holds all of it.
    router = Router(pool)
    router.learn(c.address, events(snapshot=True, device=names[:2], host=names[2:5], stored=names[:8], domain="d"))
    pair = router.choose(p)
    assert pair.generate is c
    assert pair.why == "holds the prompt's first 2 pages, 3 more in host memory, 3 more in storage"
    # Pages the host tier let go of, or a host flush, leave only what storage holds.
    router.learn(c.address, events(host_gone=names[2:5], domain="d"))
    assert router.held.pages(c.address, names) == (2, 2, 8)
    router.learn(c.address, events(host=names[2:5], domain="d"))
    assert router.held.pages(c.address, names) == (2, 5, 8)
    router.learn(c.address, events(cleared=["host"], domain="d"))
    assert router.held.pages(c.address, names) == (2, 2, 8)


def test_a_worker_whose_event_stream_ended_is_forgotten():
    pool = make_pool("colocated", {"colocated": 2})
    router = Router(pool)
    a, b = pool.of_role("colocated")
    p = prompt(7)
    router.learn(b.address, events(snapshot=True, stored=router._prefix_hashes(p, PAGE), domain="d"))
    router.held.forget(b.address)
    assert router.held.pages(b.address, router._prefix_hashes(p, PAGE)) == (0, 0, 0)
    assert router.held.storage == {}  # no worker is in that domain any more


def test_a_salted_prompt_meets_only_its_own_salts_prefixes():
    # A worker says it holds the prompt's pages (unsalted: the workers tell nothing of salted pages), and the router
    # has sent the prompt under salt "a" to another worker: a salted prompt goes by its salt's history alone.
    pool = make_pool("colocated", {"colocated": 3})
    router = Router(pool)
    holder = pool.of_role("colocated")[0]
    p = prompt(7)
    router.learn(holder.address, events(snapshot=True, device=router._prefix_hashes(p, PAGE)))
    assert router.choose(p).generate is holder
    salted = router.choose(p, cache_salt="a")
    assert salted.why == "least loaded, no known prefix"
    salted.generate.in_flight += 1
    assert router.choose(p, cache_salt="a").generate is salted.generate  # its own history
    assert router.choose(p, cache_salt="b").why == "least loaded, no known prefix"
