"""The identity stored KV is kept under (kv_keys.py, weights_digest.py, kv_identities.py): two checkpoints of
one shape that differ only past the first MiB of their weights, a weight update, and a native build for other
CPUs each read none of the other's pages from one storage directory and answer as computed cold; the
directory records who uses which identity, and deletes one nobody uses any more."""
from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from fixtures import make_tiny_model

from pdserve.kernels import native
from pdserve.shared import kv_identities, weights_digest as wd
from pdserve.shared.compat import WeightsVersion
from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig, TierConfig
from pdserve.shared.engine import Engine
from pdserve.shared.kv_files import KVFiles
from pdserve.shared.kv_keys import chain_keys, identity_key
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

PAGE = 4
PROMPT = [(i * 37 + 11) % 500 + 1 for i in range(41)]  # 10 full pages, and one token to compute
MIB = 1 << 20


def late_v_proj(path: Path) -> tuple[str, int, int]:
    """The v_proj weight stored last in a safetensors file: (name, first byte, end) in the file."""
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + size])
    name = max((n for n in header if "v_proj" in n), key=lambda n: header[n]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    return name, 8 + size + begin, 8 + size + end


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict[str, Path]:
    """A 3 MB checkpoint, and a copy whose last-stored v_proj is scaled by 1.5 in place: the same files, sizes and
    first MiB, other KV from the second layer on."""
    root = tmp_path_factory.mktemp("twins")
    base = make_tiny_model("qwen3", root / "base", intermediate_size=2048)
    fine = Path(shutil.copytree(base, root / "fine"))
    weights = fine / "model.safetensors"
    _, begin, end = late_v_proj(weights)
    assert begin >= MIB  # past what the old fingerprint read
    with open(weights, "r+b") as f:
        f.seek(begin)
        values = np.frombuffer(f.read(end - begin), dtype=np.float32) * np.float32(1.5)
        f.seek(begin)
        f.write(values.tobytes())
    return {"base": base, "fine": fine}


def engine_for(model: Path, storage: Path | None) -> Engine:
    tiers = TierConfig(str(storage), "write_through", "best_effort", 5.0) if storage is not None else None
    return Engine(RuntimeConfig(model_path=str(model), dtype="float32", tiers=tiers,
                                cache=CacheConfig(page_size=PAGE, max_total_tokens=PAGE * 64),
                                scheduler=SchedulerConfig(max_prefill_tokens=256)))


def generate(engine: Engine, new_tokens: int = 6) -> tuple[list[int], int]:
    """A greedy answer to PROMPT and its cached tokens, the engine stepped here as its loop would, then every
    storage write landed."""
    out: list = []
    engine.add_request(Req(rid=f"r{time.monotonic_ns()}", input_ids=list(PROMPT), on_output=out.append,
                           params=SamplingParams(temperature=0, max_new_tokens=new_tokens)))
    end = time.monotonic() + 60
    while engine.has_work() or engine.tiers.held_reqs() or engine.tiers.writing:
        assert time.monotonic() < end, "the engine did not finish"
        engine.tiers.poll()
        if engine.has_work():
            engine.step()
        else:
            time.sleep(0.002)
    return [t for o in out for t in o.token_ids], out[-1].cached_tokens


@pytest.fixture(scope="module")
def cold(twins, tmp_path_factory) -> dict[str, list[int]]:
    """Each checkpoint's answer computed cold, with a storage tier of its own."""
    return {name: generate(engine_for(path, tmp_path_factory.mktemp(name)))[0] for name, path in twins.items()}


def test_checkpoints_differing_past_the_first_mib_share_no_pages(twins, cold, tmp_path):
    a, b = (twins[n] / "model.safetensors" for n in ("base", "fine"))
    assert a.stat().st_size == b.stat().st_size and a.read_bytes()[:MIB] == b.read_bytes()[:MIB]
    assert cold["base"] != cold["fine"]  # other KV: pages read across would answer otherwise
    assert generate(engine_for(twins["base"], tmp_path)) == (cold["base"], 0)
    assert generate(engine_for(twins["base"], tmp_path)) == (cold["base"], 40)  # its own pages, read back
    assert generate(engine_for(twins["fine"], tmp_path)) == (cold["fine"], 0)
    assert generate(engine_for(twins["fine"], tmp_path)) == (cold["fine"], 40)
    by_weights = {r["weights"]: r for r in kv_identities.records(tmp_path)}
    assert set(by_weights) == {wd.weights_digest(twins["base"]), wd.weights_digest(twins["fine"])}
    assert by_weights[wd.weights_digest(twins["fine"])]["model_paths"] == [str(twins["fine"])]


def test_a_weight_update_reads_none_of_the_old_weights_pages(twins, cold, tmp_path):
    engine = engine_for(twins["base"], tmp_path)
    assert generate(engine) == (cold["base"], 0)
    old = engine.tiers.root_key
    engine.weights.stage(engine.runner.read_weights(str(twins["fine"])))
    assert engine.weights.commit(WeightsVersion(1, str(twins["fine"]))) == 0
    assert engine.tiers.root_key != old
    assert generate(engine) == (cold["fine"], 0)
    assert generate(engine_for(twins["base"], tmp_path)) == (cold["base"], 40)  # kept for workers still on them
    assert {r["weights"] for r in kv_identities.records(tmp_path)} == {wd.weights_digest(twins["base"]),
                                                                      wd.weights_digest(twins["fine"])}


def test_an_avx2_build_and_this_cpus_build_share_no_pages(twins, tmp_path, monkeypatch):
    try:
        own = native.load("native").isa()
        native.load("x86-64-v3")  # built by tests/kernels/test_avx2_build.py in a whole run
    except native.NativeUnavailable as exc:
        pytest.skip(f"no native build to compare: {exc}")
    first = engine_for(twins["base"], tmp_path)
    computed = generate(first)
    try:
        monkeypatch.setenv("PDSERVE_NATIVE_MARCH", "x86-64-v3")
        native.default_march.cache_clear()
        avx2 = engine_for(twins["base"], tmp_path)
        assert generate(avx2) == (computed[0], 0)
    finally:
        monkeypatch.delenv("PDSERVE_NATIVE_MARCH")
        native.default_march.cache_clear()
    kernels = [first.tiers._identity["kernels"]["native"], avx2.tiers._identity["kernels"]["native"]]
    assert kernels[0]["march"] == "native" and kernels[0]["isa"] == own
    assert kernels[1]["march"] == "x86-64-v3" and kernels[1]["isa"] == "avx2"


# ---------------------------------------------------------------- the weights' digest
def test_the_digest_is_hashed_once_and_again_when_a_file_changes_in_place(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(os.urandom(3 * MIB))
    hashed = []
    real = wd.file_digest
    monkeypatch.setattr(wd, "file_digest", lambda p: hashed.append(p.name) or real(p))
    monkeypatch.setattr(wd, "RACY_S", 0.0)
    first = wd.weights_digest(model)
    assert wd.weights_digest(model) == first and hashed == ["config.json", "model.safetensors"]
    assert json.loads((model / wd.CACHE_NAME).read_text())["files"]["model.safetensors"]["stat"][0] == 3 * MIB
    with open(weights, "r+b") as f:  # one byte past the first MiB, same size, same file
        f.seek(2 * MIB)
        byte = f.read(1)
        f.seek(2 * MIB)
        f.write(bytes([byte[0] ^ 1]))
    assert wd.weights_digest(model) != first and hashed[-1] == "model.safetensors"


def test_a_model_whose_directory_cannot_be_written_is_cached_in_the_users_cache(tmp_path, monkeypatch):
    model = tmp_path / "ro"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(MIB))
    (model / wd.CACHE_NAME).mkdir()  # no file can be written there (as a read-only mount, even for root)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(wd, "RACY_S", 0.0)
    digest = wd.weights_digest(model)
    assert len(list((tmp_path / "cache" / "weights").glob("ro-*.json"))) == 1
    monkeypatch.setattr(wd, "file_digest", lambda p: pytest.fail(f"{p} hashed again"))
    assert wd.weights_digest(model) == digest


# ---------------------------------------------------------------- the directory's records
def _identity_with_a_page(root: Path, key: str, used_s_ago: float | None) -> None:
    files = KVFiles(str(root), page_bytes=64, io="file")
    files.use(key, {"weights": key[:8]}, f"/models/{key[:4]}")
    files.write(chain_keys(key, [(1, 2)])[0], bytes(64))
    record = root / kv_identities.RECORDS / f"{key}.json"
    if used_s_ago is None:  # written before records were kept: only the pages' times tell
        record.unlink()
        old = time.time() - 30 * 24 * 3600
        for path in [root / key, *(root / key).iterdir()]:
            os.utime(path, (old, old))
    else:
        data = json.loads(record.read_text())
        data["last_used"] = kv_identities._stamp(time.time() - used_s_ago)
        record.write_text(json.dumps(data))


def test_identities_nobody_uses_are_deleted_and_in_use_ones_kept(tmp_path, monkeypatch):
    old, legacy, recent = (identity_key({"weights": w}) for w in ("old", "legacy", "recent"))
    monkeypatch.setenv("PDSERVE_KV_RETAIN_HOURS", "0")  # kept forever, while they are made
    _identity_with_a_page(tmp_path, old, used_s_ago=8 * 24 * 3600)
    _identity_with_a_page(tmp_path, legacy, used_s_ago=None)
    _identity_with_a_page(tmp_path, recent, used_s_ago=3 * 3600)
    assert (tmp_path / old).exists() and (tmp_path / legacy).exists()
    monkeypatch.delenv("PDSERVE_KV_RETAIN_HOURS")  # a week
    mine = identity_key({"weights": "mine"})
    files = KVFiles(str(tmp_path), page_bytes=64, io="file")
    files.use(mine, {"weights": "mine", "kernels": {"set": "native"}}, "/models/mine")
    files.write(chain_keys(mine, [(1, 2)])[0], bytes(64))
    assert not (tmp_path / old).exists() and not (tmp_path / legacy).exists()
    assert (tmp_path / recent).exists()
    (record,) = [r for r in kv_identities.records(tmp_path) if r["key"] == mine]
    assert record["model_paths"] == ["/models/mine"] and record["kernels"] == {"set": "native"}
    assert list(record["hosts"]) and record["first_used"] <= record["last_used"]
    files._count_error("write", OSError(errno.ENOSPC, "No space left on device"))  # the disk is full
    assert not (tmp_path / recent).exists() and (tmp_path / mine).exists()
    assert [r["key"] for r in kv_identities.records(tmp_path)] == [mine]
    monkeypatch.setenv("PDSERVE_KV_RETAIN_HOURS", "a week")
    with pytest.raises(ValueError, match="PDSERVE_KV_RETAIN_HOURS"):
        KVFiles(str(tmp_path), page_bytes=64, io="file")
