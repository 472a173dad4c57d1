"""A generative worker is two processes: its front (gRPC, health, metrics) and the engine process it starts. What a
user sees when either dies under load, and what stays behind: nothing.

Real workers on a tiny model; 8 gRPC streams run while one of the two processes is SIGKILLed.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from fixtures import make_tiny_model
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams
from procs import children, start_worker

STREAMS = 8
UNHEALTHY_WITHIN_S = 2.0
ENDED_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("engine-process") / "llama"))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def channel_dir(pid: int) -> str:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)["PDSERVE_ENGINE_CHANNEL"]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class Streams:
    """STREAMS long greedy generations on one worker, each noting its tokens and how it ended."""

    def __init__(self, addr: str) -> None:
        self.tokens = [0] * STREAMS
        self.ended: list[str | None] = [None] * STREAMS
        self.channel = grpc.insecure_channel(addr)
        stub = pb_grpc.WorkerStub(self.channel)
        params = params_to_proto(SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True))
        self.threads = [threading.Thread(target=self._run, args=(stub, i, params), daemon=True)
                        for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, stub, i: int, params) -> None:
        try:
            for msg in stub.Generate(pb.GenerateRequest(rid=f"s{i}", input_ids=[1, 5, 9, 13], sampling=params),
                                     timeout=120):
                self.tokens[i] += sum(len(c.token_ids) for c in msg.choices)
            self.ended[i] = "finished"
        except grpc.RpcError as exc:
            self.ended[i] = exc.code().name

    def wait_flowing(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.tokens) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(self.tokens), f"streams did not start: {self.tokens} {self.ended}"

    def wait_ended(self, timeout: float) -> list[str | None]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.channel.close()
        return self.ended


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
