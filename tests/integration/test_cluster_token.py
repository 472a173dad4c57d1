"""Internal traffic needs the cluster token: real prefill, decode and gateway processes on a tiny model, all
given PDSERVE_CLUSTER_TOKEN, serve as usual over the TCP KV transfer; a caller or a decode worker without the
token is refused with a clear error, at once."""
from __future__ import annotations

import grpc
import pytest
import requests

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.shared.cluster_auth import METADATA_KEY, TOKEN_ENV
from procs import Proc, free_port, start_worker

TOKEN = "test-cluster-token-6b1e0c"


@pytest.fixture(scope="module")
def system(tiny_models):
    model = str(tiny_models["llama"])
    flags = ("--model-path", model, "--dtype", "float32", "--transfer-backend", "tcp")
    env = {TOKEN_ENV: TOKEN}
    procs: list[Proc] = []
    try:
        prefill, paddr = start_worker("prefill", None, *flags, env=env)
        procs.append(prefill)
        decode, daddr = start_worker("decode", None, *flags, "--prefill", paddr, env=env)
        procs.append(decode)
        port = free_port()
        gateway = Proc("gateway", ["gateway", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
                                   "--health-check-interval", "0.5", "--prefill", paddr, "--decode", daddr],
                       health_url=f"http://127.0.0.1:{port}/health").start(env)
        procs.append(gateway)
        for proc in procs:
            proc.wait_healthy(300)
        yield {"model": model, "flags": flags, "prefill": paddr, "decode": daddr, "url": f"http://127.0.0.1:{port}"}
    finally:
        for proc in procs:
            proc.stop()


def test_holders_of_the_token_serve_requests_through_prefill_and_decode(system):
    r = requests.post(system["url"] + "/v1/completions", timeout=60,
                      json={"model": "default", "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("metadata", [None, ((METADATA_KEY, "a-wrong-token"),)])
def test_a_call_without_the_token_is_refused(system, metadata):
    with grpc.insecure_channel(system["decode"]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.WorkerStub(channel).Health(pb.Empty(), timeout=10, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN_ENV in info.value.details()
    with grpc.insecure_channel(system["decode"]) as channel:  # with it, the same call is answered
        reply = pb_grpc.WorkerStub(channel).Health(pb.Empty(), timeout=10, metadata=((METADATA_KEY, TOKEN),))
    assert reply.ok


def test_a_decode_worker_without_the_token_stops_at_once_saying_why(system):
    proc, _ = start_worker("decode", None, *system["flags"], "--prefill", system["prefill"])
    try:
        assert proc.popen.wait(60) == 1  # not the 120 s a prefill worker that is still starting gets
        assert "requires the cluster token" in proc.tail()
    finally:
        proc.stop()


def test_a_generate_stream_without_the_token_is_refused_before_any_call_runs(system):
    # GenerateMany carries many generations on one stream (the gateway's): the check covers it as a whole.
    start = pb.GenerateCall(call=1, start=pb.GenerateRequest(rid="no-token", input_ids=[1, 2, 3],
                                                             prefill_addr=system["prefill"]))
    with grpc.insecure_channel(system["decode"]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.WorkerStub(channel).GenerateMany(iter([start]), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN_ENV in info.value.details()
