"""A prefill worker's KV write that comes after its request was aborted never lands in pages another request holds.

Real processes on a tiny model, for each transfer backend: a decode worker registered with two prefill workers,
the slow one waiting WRITE_DELAY_S before each KV write (the test hook PDSERVE_TEST_KV_WRITE_DELAY_S). Request A
goes through the slow one and is cancelled while its write waits: its pages come back to the decode worker as
soon as A's fence is settled (NIXL: the slow worker revoked it; TCP: the receiver closed A's window, and refuses
a write under A's fence from then on), well before A's write comes due. Request B, through the other
prefill worker, gets exactly those pages (the allocator hands out the latest freed first) and keeps them in the
prefix cache, where the second B reads them after A's write came due: both answer what B answers alone, and the
slow worker reports A's write refused and the abort that came late.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request
import uuid

import grpc
import pytest

from fixtures import make_tiny_model
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

WRITE_DELAY_S = 4.0
PROMPT_TOKENS = 96  # A and B: as many pages each
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def trio(request, tmp_path_factory):
    if request.param == "nixl":
        pytest.importorskip("nixl", reason="NIXL is not installed")
    model = str(make_tiny_model("llama", tmp_path_factory.mktemp("late-write") / "llama"))
    flags = ("--model-path", model, "--dtype", "float32", "--transfer-backend", request.param)
    slow, slow_addr = start_worker("prefill", None, *flags, env={"PDSERVE_TEST_KV_WRITE_DELAY_S": str(WRITE_DELAY_S)})
    fast, fast_addr = start_worker("prefill", None, *flags)
    procs = [slow, fast]
    try:
        for proc in procs:
            proc.wait_healthy(180)
        decode, daddr = start_worker("decode", None, *flags, "--prefill", slow_addr, "--prefill", fast_addr,
                                     "--local-prefill-max-tokens", "0")
        procs.append(decode)
        decode.wait_healthy(180)
        yield slow, slow_addr, fast_addr, daddr
    finally:
        for proc in reversed(procs):
            proc.stop()


def request(ids: list[int], prefill: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, prefill_addr=prefill, sampling=params_to_proto(
        SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)))


async def generate(daddr: str, ids: list[int], prefill: str) -> list[tuple[int, float]]:
    """Each output token with its logprob: any change of the prompt's KV shows in them."""
    out: list[tuple[int, float]] = []
    async with grpc.aio.insecure_channel(daddr) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(request(ids, prefill), timeout=60):
            for c in msg.choices:
                out += zip(c.token_ids, c.logprobs)
    return out


async def used_pages(daddr: str, more_than: int | None) -> bool:
    """Whether the decode worker holds more than `more_than` pages for requests (None: whether it holds none)."""
    async with grpc.aio.insecure_channel(daddr) as ch:
        stats = await pb_grpc.WorkerStub(ch).Stats(pb.Empty(), timeout=10)
    assert stats.integrity_ok, stats.integrity_message
    return stats.used_pages == 0 if more_than is None else stats.used_pages > more_than


def metric(proc, name: str) -> float:
    url = proc.health_url.rsplit("/", 1)[0] + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


async def wait_for(what, timeout: float) -> float:
    """When `what()` (a bool, or a coroutine of one) turned true."""
    async def holds() -> bool:
        result = what()
        return await result if asyncio.iscoroutine(result) else result

    start = time.monotonic()
    while not await holds():
        assert time.monotonic() - start < timeout, f"still waiting after {timeout} s"
        await asyncio.sleep(0.05)
    return time.monotonic()


async def test_a_write_late_past_its_abort_never_lands_in_reused_pages(trio):
    slow, slow_addr, fast_addr, daddr = trio
    a_ids = [(7 * i + 3) % 500 + 5 for i in range(PROMPT_TOKENS)]
    b_ids = [(11 * i + 1) % 500 + 5 for i in range(PROMPT_TOKENS)]
    alone = await generate(daddr, b_ids, fast_addr)
    async with grpc.aio.insecure_channel(daddr) as ch:  # B's pages leave the prefix cache: B is computed again
        assert (await pb_grpc.WorkerStub(ch).FlushCache(pb.FlushRequest(), timeout=10)).ok

    refused = metric(slow, "pdserve_worker_kv_transfer_failures_total")
    sent = time.monotonic()
    doomed = asyncio.ensure_future(generate(daddr, a_ids, slow_addr))
    await wait_for(lambda: used_pages(daddr, more_than=0), 10)  # A's pages are reserved, its prefill under way
    await asyncio.sleep(0.5)
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    back = await wait_for(lambda: used_pages(daddr, more_than=None), 10)
    assert back < sent + WRITE_DELAY_S - 0.5, "the pages came back only once A's write was due: nothing raced"

    assert await generate(daddr, b_ids, fast_addr) == alone  # on A's pages, kept in the prefix cache after
    await asyncio.sleep(max(0.0, sent + WRITE_DELAY_S + 1.0 - time.monotonic()))  # A's write came due
    assert await generate(daddr, b_ids, fast_addr) == alone  # B's cached pages, read after A's write came due
    assert metric(slow, "pdserve_worker_kv_transfer_failures_total") > refused  # A's write was refused
    assert metric(slow, "pdserve_worker_kv_fence_failures_total") >= 1  # the abort that could not run at once
    assert await used_pages(daddr, more_than=None)
