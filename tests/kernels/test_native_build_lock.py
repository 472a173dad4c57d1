"""The native build's lock: a build killed midway must not make every later worker wait forever.

torch's cpp_extension guards a build folder with a plain `lock` file, which a killed build leaves behind; the
next load then waits for it without end (a worker that never starts and says nothing). The build runs under an
flock instead, which dies with its holder, and clears such a leftover before torch looks.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.kernels import native

HOLD = """
import fcntl, sys, time
handle = open(sys.argv[1], "w")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def holder(path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_file_left_by_a_killed_build_is_cleared(tmp_path):
    (tmp_path / "lock").touch()  # what torch leaves when its build is killed
    with native._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_build_killed_midway_does_not_hold_the_next_one(tmp_path):
    proc = holder(tmp_path / "build.flock")
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    with native._build_lock(tmp_path):
        assert time.monotonic() - t0 < 5


def test_a_live_build_is_waited_for_but_not_forever(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "BUILD_WAIT_S", 1.0)
    proc = holder(tmp_path / "build.flock")
    try:
        (tmp_path / "lock").touch()  # torch's lock of that live build: kept while it runs
        with pytest.raises(TimeoutError, match="building"):
            with native._build_lock(tmp_path):
                pass
        assert (tmp_path / "lock").exists()
    finally:
        proc.kill()
        proc.wait()
    with native._build_lock(tmp_path):  # once that build is over, the next one goes on at once
        pass
