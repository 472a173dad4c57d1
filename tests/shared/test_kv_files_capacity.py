"""The storage tier's bounds: a cap kept with least-recently-used eviction, old identities first, a minimum free
space, temporary files of killed writers removed; every deletion counted."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from pdserve.shared import kv_file_capacity
from pdserve.shared.kv_file_capacity import Limits, parse_size
from pdserve.shared.kv_files import KVFiles
from pdserve.shared.kv_keys import chain_keys, identity_key

PAGE = 512 * 1024
CAP = 64 * 2**20


def on_disk(root: Path) -> int:
    """Bytes the directory takes on its volume, every file in it (records and the key included)."""
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def tier(root: Path, model: str = "m", **limits) -> KVFiles:
    files = KVFiles(str(root), page_bytes=PAGE, io="file", limits=Limits(**limits))
    files.use(identity_key({"model": model}), {"model": model})
    files.capacity.walk_now()
    return files


def fill(files: KVFiles, pages: int, start: int = 0) -> list[str]:
    keys = chain_keys(files.identity, [(start + i,) for i in range(pages)])
    payload = os.urandom(PAGE)
    for key in keys:
        assert files.write(key, payload)
    return keys


def test_a_capped_directory_stays_under_its_cap_keeping_what_was_used_last(tmp_path):
    files = tier(tmp_path, max_bytes=CAP)
    keys = fill(files, 64)
    hot = keys[0]
    for n in range(1, 8):  # 8 x 64 pages of 0.5 MiB: 256 MiB written, four times the cap
        assert files.read(hot) is not None  # read between writes: the least recently used are the others
        keys += fill(files, 64, start=64 * n)
        assert on_disk(tmp_path) <= CAP * 1.1
    assert on_disk(tmp_path) >= CAP * 0.8  # eviction stops at the ratio (0.9), not at empty
    assert files.contains(hot) and files.contains(keys[-1]) and not files.contains(keys[1])
    counts = files.capacity.counts
    assert counts.evicted_pages == 512 - len(files.capacity._lru) and counts.evicted_bytes >= 3 * CAP
    pages, size = files.occupancy()
    assert pages == len([p for p in tmp_path.rglob("*.kv")]) and size == pages * files.file_bytes
    # a restarted worker finds the same files and keeps the cap from its first write
    again = tier(tmp_path, max_bytes=CAP)
    fill(again, 32, start=10_000)
    assert on_disk(tmp_path) <= CAP * 1.1


def age_record(root: Path, key: str, hours: float) -> None:
    path = root / "identities" / f"{key}.json"
    record = json.loads(path.read_text())
    record["last_used"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - hours * 3600))
    path.write_text(json.dumps(record))


def test_identities_nobody_uses_go_before_any_page_of_the_workers_own(tmp_path):
    old = tier(tmp_path, model="old weights")
    fill(old, 40)
    live = tier(tmp_path, model="another rank")  # used now (its record is fresh): kept
    live_keys = fill(live, 20)
    age_record(tmp_path, old.identity, hours=2)
    files = tier(tmp_path, max_bytes=CAP)
    fill(files, 100)  # 50 MiB of its own: past the cap only with the others' 30 MiB
    assert not (tmp_path / old.identity).exists() and files.capacity.counts.evicted_identities == 1
    assert all(live.contains(key) for key in live_keys)
    assert files.capacity.counts.evicted_pages == 0
    end = time.monotonic() + 10
    while list(tmp_path.glob(".flushed-*")):  # the identity's files go on a thread of their own
        assert time.monotonic() < end
        time.sleep(0.02)
    assert on_disk(tmp_path) <= CAP * 1.1


def test_minimum_free_space_evicts_too(tmp_path, monkeypatch):
    files = tier(tmp_path, min_free_bytes=100 * 2**20)
    keys = fill(files, 80)
    real = os.statvfs

    class Full:  # the volume reported with 90 MiB free: 10 MiB under the minimum
        f_frsize, f_bavail = 4096, 90 * 2**20 // 4096

    monkeypatch.setattr(kv_file_capacity.os, "statvfs", lambda path: Full)
    files.capacity._free_checked_at = -1.0  # the volume is looked at once a second: now
    fill(files, 1, start=1000)
    monkeypatch.setattr(kv_file_capacity.os, "statvfs", real)
    evicted = files.capacity.counts.evicted_bytes
    assert 20 * 2**20 <= evicted <= 22 * 2**20  # the 10 MiB missing plus (1 - 0.9) of the minimum
    assert not files.contains(keys[0]) and files.contains(keys[-1])


def test_temporary_files_of_a_killed_writer_are_removed_at_start(tmp_path):
    files = tier(tmp_path)
    key = fill(files, 1)[0]
    directory = files._path(key).parent
    stale, fresh = directory / f".{key}.kv.dead0001", directory / f".{key}.kv.live0002"
    for path in (stale, fresh):
        path.write_bytes(b"half a page")
    os.utime(stale, (time.time() - 3600,) * 2)
    restarted = tier(tmp_path)
    assert not stale.exists() and fresh.exists()  # a write under way in another worker is left alone
    assert restarted.capacity.counts.temporaries_removed == 1 and restarted.read(key) is not None


@pytest.mark.parametrize("text, size", [("200GB", 200 * 10**9), ("500MB", 500 * 10**6), ("1.5G", 1_500_000_000),
                                        ("2GiB", 2 * 2**30), ("64Mi", 64 * 2**20), ("4096", 4096), (" 10 kb", 10_000)])
def test_sizes_read_as_sglang_writes_them(text, size):
    assert parse_size(text, "--hicache-storage-max-size") == size


@pytest.mark.parametrize("text", ["", "lots", "-1GB", "10XB", "1e9"])
def test_a_size_that_is_not_one_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match="--hicache-storage-max-size must be a size"):
        parse_size(text, "--hicache-storage-max-size")


def test_an_engines_capped_tier_stays_under_its_cap_and_answers_as_before(tiny_models, tmp_path):
    from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig, TierConfig
    from pdserve.shared.engine import Engine
    from pdserve.shared.req import Req
    from pdserve.shared.sampling_params import SamplingParams

    def engine(storage: Path | None, cap: int = 0) -> Engine:
        tiers = TierConfig(str(storage), storage_max_bytes=cap) if storage is not None else None
        return Engine(RuntimeConfig(model_path=str(tiny_models["llama"]), dtype="float32", tiers=tiers,
                                    cache=CacheConfig(page_size=4, max_total_tokens=4 * 64),
                                    scheduler=SchedulerConfig(max_prefill_tokens=256)))

    def answer(e: Engine, prompt: list[int]) -> list[int]:
        out: list[int] = []
        req = Req(rid=str(prompt[0]), input_ids=prompt, params=SamplingParams(temperature=0, max_new_tokens=4))
        req.on_output = lambda o: out.extend(o.token_ids)
        e.add_request(req)
        end = time.monotonic() + 60
        while e.has_work() or (e.tiers is not None and (e.tiers.held_reqs() or e.tiers.writing)):
            assert time.monotonic() < end
            if e.tiers is not None:
                e.tiers.poll()
            e.step() if e.has_work() else time.sleep(0.002)
        return out

    prompts = [[(i * 37 + n * 101) % 500 + 1 for i in range(121)] for n in range(8)]  # 30 pages each
    capped = engine(tmp_path)
    page_file = capped.tiers.files.file_bytes
    capped = engine(tmp_path, cap=40 * charge_of(page_file))  # 40 pages: the 8 prompts' 240 are 6 times that
    plain = engine(None)
    for prompt in prompts:
        assert answer(capped, prompt) == answer(plain, prompt)
        assert on_disk(tmp_path) <= 40 * charge_of(page_file) * 1.1
    stats = capped.tiers.stats()
    assert stats["evicted_pages"] >= 240 - 40 and stats["pages_written"] >= 240
    assert answer(capped, prompts[-1]) == answer(plain, prompts[-1])  # the latest prompt's pages are kept


def charge_of(size: int) -> int:
    return kv_file_capacity.charge(size)
