"""GenerateMany on a real worker: several generations on one stream get Generate's tokens, a step's outputs share a
message, one call's error or cancel leaves the others running, and nothing stays behind on the worker."""
from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.services.worker.front.generate_many import StepSink
from pdserve.shared.outputs import ReqOutput
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

PROMPTS = [[1, 2, 3, 4, 5], [1, 9, 8, 7], [1, 40, 41, 42, 43, 44]]


def request(prompt: list[int], new: int, **params) -> pb.GenerateRequest:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True, **params)
    return pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=prompt, sampling=params_to_proto(sampling))


@pytest.fixture(scope="module")
def worker():
    # Deterministic mode: a prompt's greedy tokens are the same bits alone and batched by construction, on every
    # CPU; these prompts of arbitrary ids have near-ties that another summation order may flip otherwise.
    proc, addr = start_worker("colocated", None, "--enable-deterministic-inference")
    try:
        proc.wait_healthy()
        yield addr
    finally:
        proc.stop()


async def alone(stub, req: pb.GenerateRequest) -> list[int]:
    return [t for msg in [m async for m in stub.Generate(req, timeout=120)] for c in msg.choices for t in c.token_ids]


def test_calls_on_one_stream_get_generates_tokens_and_share_messages(worker):
    async def run():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = pb_grpc.WorkerStub(channel)
            want = [await alone(stub, request(p, 24)) for p in PROMPTS]
            sends: asyncio.Queue = asyncio.Queue()
            for number, prompt in enumerate(PROMPTS, 1):
                sends.put_nowait(pb.GenerateCall(call=number, start=request(prompt, 24)))
            sends.put_nowait(pb.GenerateCall(call=9, start=request([1] * 9000, 4)))  # past the context: refused

            async def outgoing():
                while (message := await sends.get()) is not None:
                    yield message

            got: dict[int, list[int]] = {n: [] for n in range(1, 4)}
            ended, failed, shared = set(), {}, 0
            async for events in stub.GenerateMany(outgoing(), timeout=120):
                shared += len({e.call for e in events.events if e.HasField("response")}) > 1
                for e in events.events:
                    if e.HasField("response"):
                        got[e.call] += [t for c in e.response.choices for t in c.token_ids]
                    elif e.end:
                        ended.add(e.call)
                    else:
                        failed[e.call] = (grpc.StatusCode.INVALID_ARGUMENT.value[0] == e.status, e.details)
                if ended == {1, 2, 3}:
                    sends.put_nowait(None)  # the caller's side closes: the stream ends
            return want, got, failed, shared

    want, got, failed, shared = asyncio.run(run())
    assert [got[n] for n in (1, 2, 3)] == want
    assert failed[9][0] and "context" in failed[9][1]  # the error named for its own call, the others untouched
    assert shared >= 3  # decoding together, their tokens of a step travelled in one message


def test_a_cancelled_call_stops_on_the_worker_while_the_others_finish(worker):
    async def run():
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = pb_grpc.WorkerStub(channel)
            sends: asyncio.Queue = asyncio.Queue()
            sends.put_nowait(pb.GenerateCall(call=1, start=request(PROMPTS[0], 2000)))
            sends.put_nowait(pb.GenerateCall(call=2, start=request(PROMPTS[1], 40)))

            async def outgoing():
                while (message := await sends.get()) is not None:
                    yield message

            counts = {1: 0, 2: 0}
            ends = set()
            async for events in stub.GenerateMany(outgoing(), timeout=120):
                for e in events.events:
                    counts[e.call] += e.HasField("response")
                    if e.end:
                        ends.add(e.call)
                if counts[1] == 5:
                    sends.put_nowait(pb.GenerateCall(call=1, cancel=True))
                if 2 in ends:
                    sends.put_nowait(None)
            return counts, ends

    counts, ends = asyncio.run(run())
    assert ends == {2} and counts[2] >= 1 and counts[1] < 200  # call 1 went no further than its cancel
    with grpc.insecure_channel(worker) as channel:  # its place in the batch and its pages went back
        stub = pb_grpc.WorkerStub(channel)
        deadline = time.monotonic() + 15
        while (stub.Load(pb.Empty(), timeout=10).running or stub.Stats(pb.Empty(), timeout=10).used_pages) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stub.Load(pb.Empty(), timeout=10).running == 0 and stub.Stats(pb.Empty(), timeout=10).used_pages == 0


def test_a_step_sink_posts_each_delivery_as_one_message_gathering_up_to_the_interval():
    def build(ready, first):  # stands in for the worker's message: the tokens, and the choices it finishes
        return [t for o in ready for t in o.token_ids], {o.index for o in ready if o.finish_reason}

    def deliver(sink, *outputs):  # what the relay does with one step's outputs
        for out in outputs:
            sink.put_nowait(out)
        sink.flush()

    async def run():
        posted = []
        sink = StepSink(2, 3, build, posted.append)  # n = 2, --stream-interval 3
        deliver(sink, ReqOutput("r", 0, [1], []), ReqOutput("r", 1, [7], []))  # the first message: at once
        deliver(sink, ReqOutput("r", 0, [2], []))
        deliver(sink, ReqOutput("r", 0, [3], []), ReqOutput("r", 1, [8], []))  # three tokens: a message
        deliver(sink, ReqOutput("r", 1, [], [], finish_reason="stop"))  # a finish goes at once
        assert posted == [[1, 7], [2, 3, 8], []] and sink.finished == {1}
        deliver(sink, ReqOutput("r", 0, [4], [], finish_reason="length"))
        assert await sink.wait(lambda first: 5.0) is None and sink.finished == {0, 1}

        failing = StepSink(1, 1, build, posted.append)
        deliver(failing, ReqOutput("r", 0, [], [], error="the prefill worker is gone"))
        assert await failing.wait(lambda first: 5.0) == "the prefill worker is gone"

        quiet = StepSink(1, 1, build, posted.append)
        with pytest.raises(asyncio.TimeoutError):
            await quiet.wait(lambda first: 0.05)  # no output at all within the limit

    asyncio.run(run())
