"""A generative worker is two processes: its front (gRPC, health, metrics) and the engine process it starts. What a
user sees when either dies under load, and what stays behind: nothing.

Real workers on a tiny model; 8 gRPC streams run while one of the two processes is SIGKILLed. Each worker gets a
temporary directory of its own (TMPDIR), which every process it starts inherits: what stays behind is any live
process started with it, and anything left in it (the channel's socket directory among them).
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
GONE_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("engine-process") / "llama"))


def start(model: str, tmp: Path):
    proc, addr = start_worker("colocated", None, "--model-path", model, "--dtype", "float32",
                              env={"TMPDIR": str(tmp)})
    proc.wait_healthy(180)
    front = proc.popen.pid
    engine, = children(front)
    assert channel_dir(engine).startswith(str(tmp))  # the marker reached the engine process
    return proc, addr, front, engine


def left_behind(tmp: Path) -> list[str]:
    """The live processes started with TMPDIR=`tmp` (the worker's and whatever they started), and what is in it."""
    mark = f"TMPDIR={tmp}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0") and alive(int(environ.parent.name)):
                cmdline = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"process {environ.parent.name}: {cmdline[:120]}")
        except OSError:  # gone meanwhile, or another user's
            continue
    return found + [f"file {path}" for path in sorted(tmp.iterdir())]


def nothing_left(tmp: Path, within_s: float = GONE_WITHIN_S) -> list[str]:
    deadline = time.monotonic() + within_s
    while (found := left_behind(tmp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def test_the_engine_process_killed_under_load_fails_its_streams_at_once_and_leaves_nothing(model, tmp_path):
    proc, addr, front, engine = start(model, tmp_path)
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
        assert "engine process exited" in proc.tail(80)
        assert not (found := nothing_left(tmp_path)), found
    finally:
        proc.kill()


def test_the_front_killed_under_load_takes_its_engine_process_with_it(model, tmp_path):
    proc, addr, front, engine = start(model, tmp_path)
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
        assert not (found := nothing_left(tmp_path)), found
    finally:
        proc.kill()
        if alive(engine):
            os.kill(engine, signal.SIGKILL)


def test_the_front_loads_no_torch_and_stays_small(model, tmp_path):
    proc, addr, front, engine = start(model, tmp_path)
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
    assert not (found := nothing_left(tmp_path)), found
