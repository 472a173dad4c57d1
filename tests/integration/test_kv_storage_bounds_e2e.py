"""The storage tier's bounds and integrity through a real worker (a tiny model, gRPC): its page files private to
its user, pages forged in its directory refused and counted on /metrics (the prompt computed again, the same
tokens), and `--hicache-storage-max-size` keeping the directory under its cap while prompts whose KV is six times
that go through."""
from __future__ import annotations

import re
import stat
import time
from pathlib import Path

import grpc
import requests

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.kv_file_capacity import charge
from pdserve.shared.kv_files import HEADER
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

PAGE = 4
PROMPTS = [[(i * 37 + n * 101) % 500 + 1 for i in range(121)] for n in range(8)]  # 30 whole pages each


def worker(model: str, storage: Path, *extra: str):
    proc, addr = start_worker("colocated", None, "--model-path", model, "--dtype", "float32", "--page-size",
                              str(PAGE), "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                              "--hicache-storage-dir", str(storage), *extra)
    proc.wait_healthy(300)
    return proc, addr


def generate(addr: str, ids: list[int]) -> list[int]:
    params = params_to_proto(SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(addr) as channel:
        stream = pb_grpc.WorkerStub(channel).Generate(pb.GenerateRequest(rid=f"r{ids[0]}-{time.monotonic_ns()}",
                                                                         input_ids=ids, sampling=params), timeout=120)
        return [t for msg in stream for c in msg.choices for t in c.token_ids]


def metric(proc, name: str) -> float:
    text = requests.get(proc.health_url.replace("/health", "/metrics"), timeout=10).text
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert found, f"{name} not on /metrics"
    return float(found.group(1))


def settled(proc, timeout: float = 60.0) -> None:
    """Until the worker's storage writes stop for a second."""
    deadline, last = time.monotonic() + timeout, -1.0
    while (now := metric(proc, "pdserve_worker_kv_storage_bytes_total")) != last:
        assert time.monotonic() < deadline, "writes did not settle"
        last = now
        time.sleep(1.0)


def on_disk(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def test_private_files_forged_pages_refused_and_a_capped_directory(tiny_models, tmp_path):
    model, storage = str(tiny_models["llama"]), tmp_path / "kv"
    first, addr = worker(model, storage)
    try:
        answer = generate(addr, PROMPTS[0])
        settled(first)
    finally:
        first.stop()
    pages = sorted(storage.rglob("*.kv"))
    assert len(pages) >= 30  # the prompt's whole pages (and what the answer filled)
    assert {stat.S_IMODE(p.stat().st_mode) for p in storage.rglob("*") if p.is_file()} == {0o600}
    assert {stat.S_IMODE(p.stat().st_mode) for p in storage.rglob("*") if p.is_dir()} | {
        stat.S_IMODE(storage.stat().st_mode)} == {0o700}
    for path in pages:  # every stored page zeroed, its header kept: a forger without the key
        raw = path.read_bytes()
        path.write_bytes(raw[:HEADER.size] + bytes(len(raw) - HEADER.size))

    cap = 40 * charge(pages[0].stat().st_size)
    second, addr = worker(model, storage, "--hicache-storage-max-size", str(cap))
    try:
        assert generate(addr, PROMPTS[0]) == answer  # computed again, never read from the forged pages
        assert metric(second, "pdserve_worker_kv_storage_refused_pages_total") >= 1
        assert metric(second, "sglang:prefetched_tokens_total") == 0
        for prompt in PROMPTS[1:]:
            generate(addr, prompt)
        settled(second)
        assert on_disk(storage) <= cap * 1.1
        assert metric(second, "pdserve_worker_kv_storage_evicted_pages_total") >= 7 * 30 - 40
    finally:
        second.stop()
