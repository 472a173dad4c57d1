"""A request aborted while its prefix is read from the storage tier stops that read, and leaves nothing behind.

A real worker (a tiny model, gRPC) on a storage directory, each run of pages read slowed by the test hook
PDSERVE_TEST_KV_READ_DELAY_S: a prompt of 3 runs is stored, the pool flushed, the prompt sent again and its call
cancelled (a client gone) while the first run is read. What was read after the abort is at most the run under way;
the pool's free pages are back where they were and its integrity holds; the same prompt then answers the same
tokens, its prefix read from storage.
"""
from __future__ import annotations

import re
import time

import grpc
import requests

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.kv_tiers import READ_RUN
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

PAGE = 4
RUNS = 3
PROMPT = [(i * 53 + 7) % 500 + 1 for i in range(PAGE * READ_RUN * RUNS + 1)]
READ_DELAY_S = 1.0


def generate(addr: str, ids: list[int]) -> list[int]:
    params = params_to_proto(SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(addr) as channel:
        stream = pb_grpc.WorkerStub(channel).Generate(pb.GenerateRequest(rid=f"r{time.monotonic_ns()}",
                                                                         input_ids=ids, sampling=params), timeout=120)
        return [t for msg in stream for c in msg.choices for t in c.token_ids]


def metric(proc, name: str, label: str = "") -> float:
    text = requests.get(proc.health_url.replace("/health", "/metrics"), timeout=10).text
    found = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(label)}[^}}]*}} (\S+)$", text, re.M)
    assert found, f"{name} not on /metrics"
    return float(found.group(1))


def bytes_read(proc) -> float:
    return metric(proc, "pdserve_worker_kv_storage_bytes_total", 'direction="read"')


def settled(proc, timeout: float = 60.0) -> None:
    """Until the worker's storage writes stop for a second."""
    deadline, last = time.monotonic() + timeout, -1.0
    while (now := metric(proc, "pdserve_worker_kv_storage_bytes_total", 'direction="written"')) != last:
        assert time.monotonic() < deadline, "writes did not settle"
        last = now
        time.sleep(1.0)


def test_an_abort_stops_its_storage_read_and_frees_everything(tiny_models, tmp_path):
    proc, addr = start_worker("colocated", None, "--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                              "--page-size", str(PAGE), "--enable-hierarchical-cache", "--hicache-storage-backend",
                              "file", "--hicache-storage-dir", str(tmp_path / "kv"),
                              "--hicache-storage-prefetch-policy", "wait_complete",
                              env={"PDSERVE_TEST_KV_READ_DELAY_S": str(READ_DELAY_S)})
    try:
        proc.wait_healthy(300)
        answer = generate(addr, PROMPT)
        settled(proc)
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.WorkerStub(channel)
            assert stub.FlushCache(pb.FlushRequest(tiers=["device"]), timeout=30).ok
            before = stub.Stats(pb.Empty(), timeout=10)
            read_before = bytes_read(proc)
            lookups = metric(proc, "pdserve_worker_kv_storage_lookups_total")

            params = params_to_proto(SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
            call = stub.Generate(pb.GenerateRequest(rid="aborted", input_ids=PROMPT, sampling=params), timeout=60)
            deadline = time.monotonic() + 10
            while metric(proc, "pdserve_worker_kv_storage_lookups_total") == lookups:  # its read has begun
                assert time.monotonic() < deadline, "the request never reached the storage tier"
                time.sleep(0.05)
            call.cancel()
            time.sleep(READ_DELAY_S * (RUNS + 1.5))  # past where the whole read would have ended
            read_aborted = bytes_read(proc) - read_before

            after = stub.Stats(pb.Empty(), timeout=10)
            assert after.integrity_ok, after.integrity_message
            assert (after.free_pages, after.used_pages, after.cached_pages) == (
                before.free_pages, before.used_pages, before.cached_pages)
            assert stub.Load(pb.Empty(), timeout=10).running == 0

            assert generate(addr, PROMPT) == answer  # still served, its prefix from storage
            read_whole = bytes_read(proc) - read_before - read_aborted
        assert read_whole > 0
        assert read_aborted <= read_whole / RUNS, (read_aborted, read_whole)
    finally:
        proc.stop()
