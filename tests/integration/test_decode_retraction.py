"""A decode worker whose KV pool runs out under load: it retracts running requests and computes them again
itself (prompt and output so far), so every stream completes and the pool ends up whole.

Before, a request retracted on a decode worker waited in a queue that decode scheduling never read: its stream
froze, the engine thread spun a core, and after the stall limit the client got an error.
"""
from __future__ import annotations

import asyncio
import uuid

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

STREAMS, PROMPT, NEW = 8, 40, 96


async def stream(addr: str, prefill: str, ids: list[int]) -> tuple[int, str]:
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    request = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling=params_to_proto(params),
                                 prefill_addr=prefill)
    tokens, finish = 0, ""
    async with grpc.aio.insecure_channel(addr) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(request, timeout=90):
            for c in msg.choices:
                tokens += len(c.token_ids)
                finish = c.finish_reason or finish
    return tokens, finish


async def load(daddr: str, paddr: str) -> list[tuple[int, str]]:
    prompts = [[(7 * i + k) % 3000 + 100 for k in range(PROMPT)] for i in range(STREAMS)]
    return await asyncio.gather(*(stream(daddr, paddr, ids) for ids in prompts))


def test_every_stream_completes_when_the_decode_pool_runs_out():
    # Decode's pool: 16 pages of 16 tokens (a later --max-total-tokens wins over procs' default). Each stream
    # needs 9 pages by its end, the 8 together 72.
    prefill, paddr = start_worker("prefill", None, "--transfer-backend", "tcp", "--page-size", "16")
    decode = None
    try:
        prefill.wait_healthy()
        decode, daddr = start_worker("decode", None, "--transfer-backend", "tcp", "--prefill", paddr,
                                     "--page-size", "16", "--max-total-tokens", "256")
        decode.wait_healthy()
        results = asyncio.run(load(daddr, paddr))
        assert results == [(NEW, "length")] * STREAMS
        with grpc.insecure_channel(daddr) as ch:
            stats = pb_grpc.WorkerStub(ch).Stats(pb.Empty(), timeout=10)
        assert stats.integrity_ok and stats.used_pages == 0, stats
    finally:
        if decode is not None:
            decode.stop()
        prefill.stop()
