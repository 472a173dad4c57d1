"""A worker's Generate stream: one message per token while the client keeps up, everything queued in one message
once it falls behind, and --stream-interval tokens per message when asked (SGLang's flag)."""
from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.services.worker.front.rpc import next_outputs
from pdserve.shared.outputs import ReqOutput, TokenLogprobs, coalesce
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

NEW = 48


def test_coalesce_joins_each_choice_in_order():
    outs = [ReqOutput("r", 0, [1], [TokenLogprobs(-0.1)], prompt_tokens=5, input_logprobs=[TokenLogprobs(-1.0)]),
            ReqOutput("r", 1, [7], [TokenLogprobs(-0.7)]),
            ReqOutput("r", 0, [2, 3], [TokenLogprobs(-0.2), TokenLogprobs(-0.3)]),
            ReqOutput("r", 1, [], [], finish_reason="stop", matched_stop_token=9)]
    first, second = coalesce(outs)
    assert (first.index, first.token_ids, [lp.logprob for lp in first.logprobs]) == (0, [1, 2, 3], [-0.1, -0.2, -0.3])
    assert first.finish_reason is None and first.prompt_tokens == 5 and first.input_logprobs[0].logprob == -1.0
    assert (second.token_ids, second.finish_reason, second.matched_stop_token) == ([7], "stop", 9)
    assert outs[0].token_ids == [1]  # the inputs are left as they were


async def messages(addr: str, pause_s: float) -> list[int]:
    """Tokens per message of one greedy stream, whose reader sleeps `pause_s` after each message."""
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    request = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=[1, 2, 3, 4, 5], sampling=params_to_proto(params))
    sizes = []
    async with grpc.aio.insecure_channel(addr) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(request, timeout=120):
            sizes.append(sum(len(c.token_ids) for c in msg.choices))
            await asyncio.sleep(pause_s)
    return sizes


@pytest.fixture(scope="module")
def workers():
    plain, plain_addr = start_worker("colocated")
    grouped, grouped_addr = start_worker("colocated", None, "--stream-interval", "8")
    try:
        plain.wait_healthy()
        grouped.wait_healthy()
        yield plain_addr, grouped_addr
    finally:
        plain.stop()
        grouped.stop()


def test_a_reader_that_keeps_up_gets_a_token_per_message(workers):
    sizes = asyncio.run(messages(workers[0], 0.0))
    assert sum(sizes) == NEW and len(sizes) >= NEW * 3 // 4  # a step's token at a time, but for a late wake-up


def test_outputs_queued_behind_the_first_go_in_one_message_and_the_interval_gathers_more():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for token in (1, 2, 3):  # steps the event loop had not handed on yet
            queue.put_nowait(ReqOutput("r", 0, [token], []))
        assert [o.token_ids for o in await next_outputs(queue, 1.0, 1)] == [[1], [2], [3]]
        for token in (4, 5):
            queue.put_nowait(ReqOutput("r", 0, [token], []))
        later = asyncio.get_running_loop().call_later(0.05, queue.put_nowait, ReqOutput("r", 0, [6], []))
        gathered = await next_outputs(queue, 1.0, 3)  # waits for a third token
        assert [t for o in gathered for t in o.token_ids] == [4, 5, 6]
        later.cancel()
        queue.put_nowait(ReqOutput("r", 0, [], [], finish_reason="stop"))
        assert len(await next_outputs(queue, 1.0, 8)) == 1  # a finish goes at once
        with pytest.raises(TimeoutError):
            await next_outputs(queue, 0.05, 1)

    asyncio.run(run())


def test_stream_interval_gathers_tokens_per_message(workers):
    _, grouped = workers
    sizes = asyncio.run(messages(grouped, 0.0))
    assert sum(sizes) == NEW and sizes[0] == 1  # the first token goes at once: time to first token is kept
    assert all(n >= 8 for n in sizes[1:-1]) and len(sizes) <= 2 + NEW // 8
