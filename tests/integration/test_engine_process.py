"""A generative worker is two processes: its front (gRPC, health, metrics) and the engine process it starts. What a
user sees when either dies under load, and what stays behind: nothing.

Real workers on a tiny model; 8 gRPC streams run while one of the two processes is SIGKILLed.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fixtures import make_tiny_model
from procs import Streams, alive, channel_dir, children, healthy, start_worker

UNHEALTHY_WITHIN_S = 2.0
ENDED_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("engine-process") / "llama"))


def start(model: str):
    proc, addr = start_worker("colocated", None, "--model-path", model, "--dtype", "float32")
    proc.wait_healthy(180)
    front = proc.popen.pid
    engine, = children(front)
    return proc, addr, front, engine


def test_the_engine_process_killed_under_load_fails_its_streams_at_once_and_leaves_nothing(model):
    proc, addr, front, engine = start(model)
    directory = channel_dir(engine)
    try:
        streams = Streams(addr)
        streams.wait_flowing()
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        while healthy(proc.health_url) and time.monotonic() - killed < 10:
            time.sleep(0.02)
        unhealthy_after = time.monotonic() - killed
        ended = streams.wait_ended(ENDED_WITHIN_S)
        assert unhealthy_after <= UNHEALTHY_WITHIN_S
        assert None not in ended and "finished" not in ended, ended  # every stream ended, with an error
        assert proc.popen.wait(15) != 0  # the front exits so that its supervisor starts the worker again
        assert not alive(engine) and not Path(directory).exists()
        assert "engine process exited" in proc.tail(80)
    finally:
        proc.kill()


def test_the_front_killed_under_load_takes_its_engine_process_with_it(model):
    proc, addr, front, engine = start(model)
    directory = channel_dir(engine)
    try:
        streams = Streams(addr)
        streams.wait_flowing()
        os.kill(front, signal.SIGKILL)
        killed = time.monotonic()
        ended = streams.wait_ended(ENDED_WITHIN_S)
        assert None not in ended and "finished" not in ended, ended
        while alive(engine) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert not alive(engine), "the engine process outlived its front"
        assert not Path(directory).exists()
    finally:
        proc.kill()
        if alive(engine):
            os.kill(engine, signal.SIGKILL)


def test_the_front_loads_no_torch_and_stays_small(model):
    proc, addr, front, engine = start(model)
    try:
        maps = Path(f"/proc/{front}/maps").read_text()
        assert "libtorch" not in maps and "libtorch" in Path(f"/proc/{engine}/maps").read_text()
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{front}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        assert rss < 200 * 1024, f"the front holds {rss // 1024} MB"
        # The channel's directory was only needed to connect: gone once the worker serves.
        assert not Path(channel_dir(engine)).exists()
    finally:
        proc.stop()
    assert not alive(engine)
