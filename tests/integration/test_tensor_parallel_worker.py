"""A tensor-parallel worker is three processes here: its front, its engine process (rank 0) and rank 1, which
rank 0 starts. What a user sees when rank 1 of a decode worker dies under load (every stream ends with an error
within seconds, the worker exits for its supervisor to restart it, nothing is left behind), and a split the
model cannot take.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from fixtures import make_tiny_model
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from procs import Streams, alive, children, start_worker

ENDED_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tensor-parallel") / "llama"))


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("pdserve-tp-*")} if Path("/dev/shm").is_dir() else set()


def test_a_decode_rank_killed_under_load_ends_every_stream_and_the_worker_leaving_nothing(model):
    before = shm_files()
    prefill, paddr = start_worker("prefill", None, "--model-path", model, "--dtype", "float32",
                                  "--transfer-backend", "tcp")
    proc, addr = start_worker("decode", None, "--model-path", model, "--dtype", "float32", "--tp-size", "2",
                              "--dist-timeout", "30", "--transfer-backend", "tcp", "--prefill", paddr)
    try:
        prefill.wait_healthy(180)
        proc.wait_healthy(180)
        engine, = children(proc.popen.pid)
        rank1, = children(engine)
        assert "tensor-parallel over 2 ranks" in proc.tail(40)
        with grpc.insecure_channel(addr) as channel:  # what the gateway's /get_server_info lists per worker
            assert pb_grpc.WorkerStub(channel).Info(pb.Empty(), timeout=30).tp_size == 2
        streams = Streams(addr, prefill=paddr)
        streams.wait_flowing()
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        ended = streams.wait_ended(ENDED_WITHIN_S)
        assert None not in ended and "finished" not in ended, ended  # every stream ended, with an error
        assert time.monotonic() - killed < ENDED_WITHIN_S
        assert proc.popen.wait(15) != 0  # the worker exits so that its supervisor starts it again
        assert not alive(engine) and not alive(rank1)
        assert "tensor-parallel rank 1" in proc.tail(80)
        assert shm_files() <= before  # the ranks' shared memory went with them
    finally:
        proc.kill()
        prefill.kill()


def test_a_split_the_model_cannot_take_is_a_start_error_naming_the_numbers(model):
    out = subprocess.run([sys.executable, "-m", "pdserve", "colocated", "--model-path", model, "--tp-size", "3",
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--tp-size 3 cannot split" in out.stderr and "4 query heads in 2 KV-head groups" in out.stderr
