"""`pdserve debug` against a real prefill + decode pair: what an operator types when something is off."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from procs import free_port, start_worker


def debug(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "debug", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def pair():
    prefill, paddr = start_worker("prefill", None, "--transfer-backend", "tcp")
    prefill.wait_healthy()
    decode, daddr = start_worker("decode", None, "--transfer-backend", "tcp", "--prefill", paddr)
    decode.wait_healthy()
    yield paddr, daddr
    decode.stop()
    prefill.stop()


def test_ping_names_the_role_of_each_worker(pair):
    paddr, daddr = pair
    for addr, role in ((paddr, "prefill"), (daddr, "decode")):
        r = debug("ping", addr)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"{addr}: ok role={role} rtt=")


def test_ping_of_nothing_fails_in_one_line_within_its_timeout():
    r = debug("ping", f"127.0.0.1:{free_port()}", "--timeout", "2", timeout=30)
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_info_shows_the_kv_layout_both_sides_agree_on(pair):
    infos = [json.loads(debug("info", addr).stdout) for addr in pair]
    assert [i["role"] for i in infos] == ["prefill", "decode"]
    assert infos[0]["compat"] == infos[1]["compat"]
    compat = infos[0]["compat"]
    assert (compat["numLayers"], compat["numKvHeads"], compat["headDim"]) == (30, 3, 64)
    assert compat["transferBackend"] == "tcp"


def test_generate_through_the_pair_then_stats_show_the_prompt_cached_and_integrity_held(pair):
    paddr, daddr = pair
    r = debug("generate", "--decode", daddr, "--prefill", paddr, "--chat", "--max-new-tokens", "12",
              "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "generated; finish=" in r.stderr and "ttft=" in r.stderr
    for addr in pair:
        stats = json.loads(debug("stats", addr).stdout)
        assert stats["integrityOk"] is True, stats
        assert stats["totalPages"] > 0
    assert json.loads(debug("stats", paddr).stdout)["cachedPages"] > 0  # prefill keeps the prompt for reuse


def test_bench_transfer_prints_bandwidth_against_the_raw_transport():
    r = debug("bench-transfer", "--backend", "tcp", "--tokens", "256")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("tcp:")]
    assert any("raw" in line for line in rows) and any("write_pages" in line for line in rows)
    for line in rows:
        assert float(line.split()[-2 if "write_pages" in line else -1]) > 0  # GB/s measured, not blank
