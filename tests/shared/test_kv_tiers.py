"""The storage tier under the radix cache (shared/kv_tiers.py, kv_files.py): a prompt whose KV a worker wrote
before is served from the directory by a worker with a cold pool, with the same tokens as computing it; damaged,
missing or foreign files are computed again, never read wrong; the pool's accounting holds throughout."""
from __future__ import annotations

import importlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.services.worker.engine.tier_metrics import TierMetrics
from pdserve.shared import kv_tiers
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig, TierConfig
from pdserve.shared.engine import Engine
from pdserve.shared.kv_events import DEVICE, STORAGE, CacheEvents, prefix_hashes
from pdserve.shared.kv_files import HEADER, KVFiles
from pdserve.shared.kv_keys import chain_keys, identity_key
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

PAGE = 4
PROMPT = [(i * 37 + 11) % 500 + 1 for i in range(41)]  # 10 full pages, and one token to compute


def nixl_imports() -> bool:
    try:
        importlib.import_module("nixl._api")
    except ImportError:
        return False
    return True


HAVE_NIXL = nixl_imports()
NEEDS_NIXL = pytest.mark.skipif(not HAVE_NIXL, reason="nixl cannot be imported here: only plain file I/O to test")
IO_PATHS = ["file", pytest.param("nixl-posix", marks=NEEDS_NIXL)]


def engine_for(model_dir: Path, storage: Path | None, pages: int = 64, policy: str = "write_through",
               prefetch: str = "best_effort", timeout_s: float = 5.0, **config) -> Engine:
    tiers = TierConfig(str(storage), policy, prefetch, timeout_s) if storage is not None else None
    config = {"dtype": "float32", **config}
    return Engine(RuntimeConfig(model_path=str(model_dir), cache=CacheConfig(page_size=PAGE, max_total_tokens=PAGE * pages),
                                scheduler=SchedulerConfig(max_prefill_tokens=256), tiers=tiers, **config))


def run(engine: Engine, prompts: dict[str, list[int]], new_tokens: int = 6, deadline_s: float = 60.0,
        reqs: list[Req] = ()) -> dict:
    """{rid: (tokens, cached_tokens)} of greedy requests, the engine stepped here as its loop would. `reqs`: the
    caller's own Req for some of the prompts (its output collected here all the same)."""
    got: dict[str, tuple[list[int], int]] = {}

    def collect(out):
        tokens, _ = got.get(out.rid, ([], 0))
        got[out.rid] = (tokens + list(out.token_ids), out.cached_tokens)

    given = {req.rid: req for req in reqs}
    for rid, ids in prompts.items():
        req = given.get(rid) or Req(rid=rid, input_ids=list(ids), params=SamplingParams(temperature=0,
                                                                                       max_new_tokens=new_tokens))
        req.on_output = collect
        engine.add_request(req)
    end = time.monotonic() + deadline_s
    while engine.has_work() or (engine.tiers is not None and engine.tiers.held_reqs()):
        assert time.monotonic() < end, "the engine did not finish"
        if engine.tiers is not None:
            engine.tiers.poll()
        if engine.has_work():
            engine.step()
            report = engine.scheduler.check_integrity()
            assert report.ok, report.message
        else:
            time.sleep(0.001)
    return got


def settle(engine: Engine, timeout_s: float = 30.0) -> None:
    """Until every write asked for has landed."""
    end = time.monotonic() + timeout_s
    while engine.tiers.writing:
        assert time.monotonic() < end, "writes did not finish"
        engine.tiers.poll()
        time.sleep(0.002)


def stored_files(storage: Path) -> list[Path]:
    return sorted(storage.rglob("*.kv"))


# ---------------------------------------------------------------- the directory
def test_a_page_file_is_read_back_only_when_whole_and_its_own(tmp_path):
    files = KVFiles(str(tmp_path), page_bytes=64)
    files.use(identity_key({"model": "m"}))
    a, b = chain_keys(files.identity, [(1, 2), (3, 4)])
    assert files.write(a, bytes(range(64))) and files.write(b, bytes(64))
    assert files.read(a) == bytes(range(64)) and files.contains(b)
    path_a, path_b = files._path(a), files._path(b)
    raw = bytearray(path_a.read_bytes())
    raw[-1] ^= 1
    path_a.write_bytes(raw)  # one bit flipped in the payload
    assert files.read(a) is None and not path_a.exists()
    os.replace(path_b, files._path(a))  # a whole file, under another page's name
    assert files.read(a) is None
    files.write(b, bytes(64))
    path_b.write_bytes(path_b.read_bytes()[:HEADER.size + 10])  # torn
    assert files.read(b) is None
    assert files.counts.corrupt == 2 and files.counts.pages_read == 1
    assert files.counts.refused == 1  # the flipped bit: its MAC is wrong
    files.write(a, bytes(64))
    files.flush()
    assert files.read(a) is None and not files.contains(a)


def files_with_run(directory: Path, io: str, pages: int = 8, page_bytes: int = 4096) -> tuple[KVFiles, list, list]:
    """A KVFiles on `io` holding a run of `pages` random pages: (files, keys, payloads)."""
    files = KVFiles(str(directory), page_bytes=page_bytes, io=io)
    assert files.io == io  # NIXL, when it imports, must load its POSIX plugin
    files.use(identity_key({"model": "m"}))
    keys = chain_keys(files.identity, [(i, i + 1) for i in range(pages)])
    payloads = [os.urandom(page_bytes) for _ in keys]
    assert files.write_run(keys, payloads) == [True] * pages
    return files, keys, payloads


@pytest.mark.parametrize("io", IO_PATHS)
def test_a_run_of_pages_is_read_back_byte_exact(tmp_path, io):
    files, keys, payloads = files_with_run(tmp_path, io, pages=12)
    assert files.read_run(keys) == payloads
    assert files.read_run(keys[3:5]) == payloads[3:5]
    assert files.write_run(keys[:2], payloads[:2]) == [True, True]  # stored already: not written again
    assert (files.counts.pages_read, files.counts.pages_written, files.counts.io_fallbacks) == (14, 12, 0)
    # no temporary left: page files, the identity's record and the MAC key (no cluster token here) only
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".kv" and p.parent.name != "identities"
                and p.name != ".pdserve-storage-key"]
    with pytest.raises(ValueError, match="4096 bytes"):
        files.write_run(keys[:1], [b"short"])


def torn(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])  # not even a header


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


def corrupted(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 100] ^= 0x10
    path.write_bytes(raw)


@pytest.mark.parametrize("io", IO_PATHS)
@pytest.mark.parametrize("damage", [torn, truncated, corrupted, "foreign", "missing"])
def test_a_damaged_file_ends_a_run_there_and_is_deleted(tmp_path, io, damage):
    files, keys, payloads = files_with_run(tmp_path, io)
    bad = files._path(keys[4])
    if damage == "foreign":
        shutil.copyfile(files._path(keys[6]), bad)  # a whole page file, under another page's name
    elif damage == "missing":
        bad.unlink()
    else:
        damage(bad)
    assert files.read_run(keys) == payloads[:4]
    assert not bad.exists() and files._path(keys[5]).exists()
    bad_mac = damage is corrupted  # a flipped payload bit fails the MAC: refused, as a forged page
    assert files.counts.corrupt == (0 if damage == "missing" or bad_mac else 1)
    assert files.counts.refused == bad_mac
    assert files.read_run(keys[5:]) == payloads[5:]  # the pages after it are as good as ever


@pytest.mark.parametrize("io", IO_PATHS)
def test_a_directory_that_is_not_there_is_a_miss_and_a_counter(tmp_path, io):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    files = KVFiles(str(blocker / "kv"), page_bytes=64, io=io)
    files.use(identity_key({"model": "m"}))
    keys = chain_keys(files.identity, [(1, 2), (3, 4)])
    assert files.write_run(keys, [bytes(64)] * 2) == [False, False]
    assert files.read_run(keys) == []
    assert files.counts.errors == 3 and files.counts.pages_written == 0  # two writes, the run's read


@NEEDS_NIXL
@pytest.mark.parametrize("writer, reader", [("nixl-posix", "file"), ("file", "nixl-posix")])
def test_runs_written_by_one_path_are_read_by_the_other(tmp_path, writer, reader):
    _, keys, payloads = files_with_run(tmp_path, writer, pages=6)
    other = KVFiles(str(tmp_path), page_bytes=4096, io=reader)
    other.use(identity_key({"model": "m"}))
    assert other.read_run(keys) == payloads
    assert [other.read(key) for key in keys] == payloads


@NEEDS_NIXL
def test_a_failed_nixl_transfer_is_done_again_with_plain_io(tmp_path, monkeypatch):
    files, keys, payloads = files_with_run(tmp_path / "a", "nixl-posix", pages=1)
    real = files._nixl._transfer

    def wrong_descriptors(op, fds, staging, size):  # each file swapped for one open the other way: NIXL fails
        swapped = [os.open(os.devnull, os.O_RDONLY if op == "WRITE" else os.O_WRONLY) for _ in fds]
        for fd in fds:
            os.close(fd)
        return real(op, swapped, staging, size)
    monkeypatch.setattr(files._nixl, "_transfer", wrong_descriptors)
    keys = chain_keys(files.identity, [(i + 100, i) for i in range(6)])
    payloads = [os.urandom(4096) for _ in keys]
    assert files.write_run(keys, payloads) == [True] * 6
    assert files.read_run(keys) == payloads
    assert files.counts.io_fallbacks == 2 and files.io == "nixl-posix" and files.counts.corrupt == 0
    monkeypatch.undo()
    assert files.read_run(keys) == payloads and files.counts.io_fallbacks == 2


def test_plain_io_can_be_forced_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_FILE_IO", "file")
    assert KVFiles(str(tmp_path), page_bytes=64).io == "file"
    monkeypatch.delenv("PDSERVE_KV_FILE_IO")
    assert KVFiles(str(tmp_path), page_bytes=64).io == ("nixl-posix" if HAVE_NIXL else "file")


def test_keys_follow_the_prefix_the_namespace_and_the_identity():
    one, two = identity_key({"weights": "w1"}), identity_key({"weights": "w2"})
    base = chain_keys(one, [(1, 2), (3, 4)])
    assert chain_keys(one, [(1, 2), (3, 4)]) == base
    assert chain_keys(one, [(9, 2), (3, 4)])[1] != base[1]  # the same page after another prefix
    assert chain_keys(one, [("adapter", 1, 2), (3, 4)])[0] != base[0]
    assert chain_keys(two, [(1, 2), (3, 4)])[0] != base[0]


def test_occupancy_is_counted_off_the_caller_and_empty_after_a_flush(tmp_path):
    files = KVFiles(str(tmp_path), page_bytes=64)
    files.use(identity_key({"model": "m"}))
    for key in chain_keys(files.identity, [(1, 2), (3, 4), (5, 6)]):
        files.write(key, bytes(64))
    end = time.monotonic() + 10
    while files.occupancy() != (3, 3 * (HEADER.size + 64)):  # the first call starts a count and answers at once
        assert time.monotonic() < end, files.occupancy()
        time.sleep(0.01)
    files.flush()
    assert files.occupancy() == (0, 0)


def test_a_directory_that_cannot_be_written_is_a_start_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        KVFiles.check_directory(str(blocker / "kv"))


# ---------------------------------------------------------------- the engine
def test_a_cold_pool_serves_a_stored_prefix_with_the_same_tokens(tiny_models, tmp_path):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None), {"a": PROMPT})
    first = engine_for(model, tmp_path)
    assert run(first, {"a": PROMPT}) == plain
    settle(first)
    assert len(stored_files(tmp_path)) >= 10  # the prompt's pages (and the output's full pages)
    cold = engine_for(model, tmp_path)
    req = Req(rid="a", input_ids=list(PROMPT), params=SamplingParams(temperature=0, max_new_tokens=6))
    again = run(cold, {"a": PROMPT}, reqs=[req])
    assert again["a"][0] == plain["a"][0]
    assert again["a"][1] == 40  # every full page of the prompt came from storage: cached_tokens counts them
    assert req.tier_tokens == {"storage": 40}
    stats = cold.tiers.stats()
    assert stats["hits"] == 1 and stats["io"] == ("nixl-posix" if HAVE_NIXL else "file")
    TierMetrics(CollectorRegistry(), "m", PAGE).refresh(stats)  # the metrics take the numbers, leave the name


def test_damaged_missing_and_foreign_files_are_computed_again(tiny_models, tmp_path):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None), {"a": PROMPT})
    writer = engine_for(model, tmp_path)
    run(writer, {"a": PROMPT})
    settle(writer)
    files = stored_files(tmp_path)
    files[0].write_bytes(files[0].read_bytes()[:-3])  # truncated
    raw = bytearray(files[1].read_bytes())
    raw[HEADER.size + 5] ^= 0xFF  # corrupted
    files[1].write_bytes(raw)
    files[2].unlink()
    for k in range(3):
        cold = engine_for(model, tmp_path)
        assert run(cold, {"a": PROMPT})["a"][0] == plain["a"][0]
        settle(cold)
    other = engine_for(model, tmp_path, quantization=None, dtype="bfloat16")  # other arithmetic: other keys
    assert run(other, {"a": PROMPT})["a"][1] == 0


def test_write_back_keeps_what_the_pool_evicts(tiny_models, tmp_path):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None), {"a": PROMPT})
    small = engine_for(model, tmp_path, pages=24, policy="write_back")
    # No eviction dropped for the writer being behind (a quarter of the pool waiting: counted, not a fault, and
    # on a busy machine the writer thread can be that far behind within one request's evictions).
    small.tiers.writer.limit_pages = 1 << 20
    run(small, {"a": PROMPT})
    assert not stored_files(tmp_path)  # nothing evicted yet
    others = {f"b{k}": [(k * 13 + i * 7) % 400 + 50 for i in range(41)] for k in range(3)}
    for rid, ids in others.items():
        run(small, {rid: ids})
    settle(small)
    assert stored_files(tmp_path)
    back = run(small, {"a2": PROMPT})["a2"]
    assert back[0] == plain["a"][0] and back[1] > 0


def test_an_abort_while_loading_leaves_nothing_behind(tiny_models, tmp_path):
    model = tiny_models["llama"]
    writer = engine_for(model, tmp_path)
    run(writer, {"a": PROMPT})
    settle(writer)
    cold = engine_for(model, tmp_path)
    outputs = []
    cold.add_request(Req(rid="a", input_ids=list(PROMPT), on_output=outputs.append,
                         params=SamplingParams(temperature=0, max_new_tokens=4)))
    assert cold.tiers.held_reqs() and cold.scheduler.find("a")
    assert cold.abort("a")
    assert outputs[-1].finish_reason == "abort" and not cold.scheduler.live_reqs()
    time.sleep(0.2)
    cold.tiers.poll()  # the read ends after the abort: nothing is queued, no page is held
    assert not cold.has_work() and cold.scheduler.check_integrity().ok
    assert cold.allocator.num_free == cold.allocator.num_pages - cold.cache.num_pages


LONG = [(i * 53 + 7) % 480 + 3 for i in range(121)]  # 30 full pages: past a quarter of a 64-page pool (16)


def long_prompt(k: int) -> list[int]:
    return [(k * 17 + i * 29) % 450 + 40 for i in range(121)]


def test_a_prompt_longer_than_the_writers_backlog_is_stored_in_parts_and_comes_back(tiny_models, tmp_path,
                                                                                     monkeypatch):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None), {"a": LONG})
    engine = engine_for(model, tmp_path)
    writer = engine.tiers.writer
    assert writer.limit_pages == 16
    waiting, real = [], engine.tiers.files.write_run

    def write_run(keys, payloads):  # what waits to be written, seen as each run is
        waiting.append(writer.pending_pages)
        return real(keys, payloads)
    monkeypatch.setattr(engine.tiers.files, "write_run", write_run)
    assert run(engine, {"a": LONG}) == plain
    settle(engine)
    assert len(waiting) >= 2 and max(waiting) <= 16  # in parts, never more than the limit at once
    assert len(stored_files(tmp_path)) >= 30 and engine.tiers.stats()["writes_dropped"] == 0
    for k in range(3):  # pushed out of the pool by three others as long
        run(engine, {f"b{k}": long_prompt(k)})
        settle(engine)
    req = Req(rid="a2", input_ids=list(LONG), params=SamplingParams(temperature=0, max_new_tokens=6))
    again = run(engine, {"a2": LONG}, reqs=[req])["a2"]
    assert again == (plain["a"][0], 120) and req.tier_tokens.get("storage", 0) >= 64
    cold = run(engine_for(model, tmp_path), {"a": LONG})["a"]  # and for a worker with a cold pool: all of it
    assert cold == (plain["a"][0], 120)


def test_pages_waiting_their_turn_that_the_pool_evicts_are_dropped_and_counted(tiny_models, tmp_path, monkeypatch):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None), {"a": LONG})
    engine = engine_for(model, tmp_path)
    gate, real = threading.Event(), engine.tiers.files.write_run

    def stalled(keys, payloads):  # a disk that takes the first part and then stalls
        gate.wait(30)
        return real(keys, payloads)
    monkeypatch.setattr(engine.tiers.files, "write_run", stalled)
    try:
        assert run(engine, {"a": LONG}) == plain
        for k in range(2):  # the pool needs the pages of "a" past the part being written: it takes them
            run(engine, {f"b{k}": long_prompt(k)})
        stats = engine.tiers.stats()
        assert stats["writes_dropped_evicted"] > 0 and engine.tiers.writer.pending_pages == 16
    finally:
        gate.set()
    settle(engine)
    stats = engine.tiers.stats()
    assert stats["writes_dropped"] == stats["writes_dropped_evicted"] + stats["writes_dropped_behind"]
    assert not engine.tiers.paths.waiting and engine.scheduler.check_integrity().ok
    registry = CollectorRegistry()
    TierMetrics(registry, "m", PAGE).refresh(stats)
    assert registry.get_sample_value("pdserve_worker_kv_storage_dropped_writes_total",
                                     {"model_name": "m", "reason": "evicted"}) == stats["writes_dropped_evicted"]
    tokens, cached = run(engine_for(model, tmp_path), {"a": LONG})["a"]  # the part written comes back
    assert tokens == plain["a"][0] and 64 <= cached < 120


@pytest.mark.parametrize("prefetch", ["timeout", "best_effort"])
def test_a_read_slower_than_its_deadline_computes_instead(tiny_models, tmp_path, prefetch, monkeypatch):
    model = tiny_models["llama"]
    plain = run(engine_for(model, None), {"a": PROMPT})
    writer = engine_for(model, tmp_path)
    run(writer, {"a": PROMPT})
    settle(writer)
    cold = engine_for(model, tmp_path, prefetch=prefetch, timeout_s=0.2)
    real_read_run = cold.tiers.files.read_run
    monkeypatch.setattr(kv_tiers, "READ_RUN", 2)

    def slow_read_run(keys):  # a disk that answers a run of two pages in time, then stalls
        if cold.tiers.files.counts.pages_read >= 2:
            time.sleep(0.3)
        return real_read_run(keys)
    monkeypatch.setattr(cold.tiers.files, "read_run", slow_read_run)
    started = time.monotonic()
    tokens, cached = run(cold, {"a": PROMPT})["a"]
    assert tokens == plain["a"][0]
    assert time.monotonic() - started < 2.0
    assert cold.tiers.stats()["given_up"] == 1
    assert cached == (2 * PAGE if prefetch == "best_effort" else 0)


def test_deterministic_bf16_is_identical_with_and_without_the_tier(default_model_dir, tmp_path, chat):
    ids = chat("Summarise in one line: " + "the quick brown fox jumps over the lazy dog. " * 6)
    prompts = {"a": ids}
    config = dict(dtype="bfloat16", deterministic=True)
    plain = run(engine_for(default_model_dir, None, pages=256, **config), prompts, new_tokens=12)
    writer = engine_for(default_model_dir, tmp_path, pages=256, **config)
    assert run(writer, prompts, new_tokens=12) == plain
    settle(writer)
    cold = engine_for(default_model_dir, tmp_path, pages=256, **config)
    tokens, cached = run(cold, prompts, new_tokens=12)["a"]
    assert tokens == plain["a"][0] and cached == (len(ids) - 1) // PAGE * PAGE


def test_the_routers_are_told_what_is_stored_and_where(tiny_models, tmp_path):
    """What the tier tells (kv_events.py): the pages written and read, by the names a router gives the prompt's
    pages, under a domain that every worker on the directory shares; a flush clears them."""
    model = tiny_models["llama"]
    names = prefix_hashes(PROMPT, PAGE, 64)[:10]
    writer = engine_for(model, tmp_path / "kv")
    writer.cache.events = writer.tiers.events = CacheEvents()
    run(writer, {"a": PROMPT})
    settle(writer)
    _, cleared, added, _ = writer.tiers.events.drain()
    assert set(names) <= set(added[DEVICE]) and set(names) <= set(added[STORAGE])
    reader = engine_for(model, tmp_path / "kv")
    reader.cache.events = reader.tiers.events = CacheEvents()
    assert reader.tiers.domain == writer.tiers.domain != engine_for(model, tmp_path / "other").tiers.domain
    assert run(reader, {"a": PROMPT})["a"][1] == 40
    assert set(names) <= set(reader.tiers.events.drain()[2][STORAGE])  # read back: stored, as far as it knows
    settle(reader)
    assert reader.flush_cache()
    assert reader.tiers.events.drain()[1] == [DEVICE, STORAGE]
