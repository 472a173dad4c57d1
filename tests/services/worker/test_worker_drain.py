"""SIGTERM on a real colocated worker (the default model) with Generate streams in progress: the worker reports
not ready and draining, refuses new calls, finishes the streams it runs, then exits."""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

TOKENS = 400  # 4 s or more at one thread, on the fastest CPUs here: longer than the 2 s a stopping gRPC server
# grants on its own


def request(rid: str) -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=TOKENS, ignore_eos=True)
    return pb.GenerateRequest(rid=rid, input_ids=[1, 504, 3458, 314], sampling=params_to_proto(params))


def health_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_sigterm_finishes_the_streams_in_progress_and_refuses_new_ones(default_model_dir):
    proc, addr = start_worker("colocated", str(default_model_dir), threads=1)
    try:
        proc.wait_healthy(120)
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.WorkerStub(channel)
            streams = [stub.Generate(request(f"r{i}"), timeout=60) for i in range(2)]
            firsts = [next(s) for s in streams]  # both running
            results: dict[int, list] = {}

            def drain(i: int) -> None:
                results[i] = [firsts[i], *streams[i]]

            readers = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
            for t in readers:
                t.start()
            os.kill(proc.popen.pid, signal.SIGTERM)
            stopped = time.monotonic()

            deadline = time.monotonic() + 5
            while health_status(proc.health_url) != 503:
                assert time.monotonic() < deadline, "still ready after SIGTERM"
                time.sleep(0.02)
            try:
                next(stub.Generate(request("late"), timeout=10))
                raise AssertionError("a new Generate call was taken while draining")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            # What the gateway reads to stop routing here without failing the streams in progress.
            health = stub.Health(pb.Empty(), timeout=5)
            assert (health.ok, health.draining) == (False, True)
            for t in readers:
                t.join(60)
            drained = time.monotonic() - stopped
        for i in range(2):  # every token, and the finish
            tokens = [t for msg in results[i] for c in msg.choices for t in c.token_ids]
            assert len(tokens) == TOKENS and results[i][-1].choices[-1].finish_reason == "length"
        assert drained > 2.5  # the streams outlived the gRPC server's own grace: the drain held it open
        assert proc.popen.wait(15) == 0
    finally:
        proc.stop()
