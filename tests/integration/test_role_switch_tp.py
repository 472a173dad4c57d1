"""A tensor-parallel worker switches roles as a unit: a decode worker over two ranks turns prefill and the prefill
worker beside it turns decode, with no process restarted, and the swapped pair answers as one process does (each
rank of the new prefill worker now sends the KV heads it holds, into the new decode worker's single rank).
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from procs import children, greedy_in_one_process, start_worker
from test_pd_workers import FP32, QUESTIONS, assert_clean, generate, tokenizer  # noqa: F401 (a fixture)
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS[:1]]


async def switch(addr: str, role: str, prefill_addrs: list[str] = ()) -> pb.SwitchRoleReply:
    async with grpc.aio.insecure_channel(addr) as ch:
        return await pb_grpc.WorkerStub(ch).SwitchRole(pb.SwitchRoleRequest(role=role, prefill_addrs=prefill_addrs),
                                                        timeout=60)


async def role_of(addr: str) -> str:
    async with grpc.aio.insecure_channel(addr) as ch:
        return (await pb_grpc.WorkerStub(ch).Health(pb.Empty(), timeout=10)).role


def test_a_tensor_parallel_decode_worker_turns_prefill_as_a_unit(default_model_dir, prompts):
    want = greedy_in_one_process(default_model_dir, prompts, NEW_TOKENS)
    prefill, paddr = start_worker("prefill", None, *FP32, "--transfer-backend", "tcp")
    decode = None
    try:
        decode, daddr = start_worker("decode", None, *FP32, "--transfer-backend", "tcp", "--prefill", paddr,
                                     "--local-prefill-max-tokens", "0", "--tp-size", "2")
        prefill.wait_healthy()
        decode.wait_healthy()
        ranks = {pid for proc in (prefill, decode) for pid in children(proc.popen.pid)}

        async def run():
            before = [(await generate(daddr, ids, prefill=paddr, max_new_tokens=NEW_TOKENS))["tokens"][0]
                      for ids in prompts]
            assert (await switch(daddr, "prefill")).info.role == "prefill"
            assert (await switch(paddr, "decode", [daddr])).info.role == "decode"
            assert [await role_of(a) for a in (daddr, paddr)] == ["prefill", "decode"]
            after = [(await generate(paddr, ids, prefill=daddr, max_new_tokens=NEW_TOKENS))["tokens"][0]
                     for ids in prompts]
            await assert_clean(paddr, daddr)
            return before, after

        before, after = asyncio.run(run())
        assert before == want and after == want
        assert {pid for proc in (prefill, decode) for pid in children(proc.popen.pid)} == ranks  # none restarted
    finally:
        if decode is not None:
            decode.stop()
        prefill.stop()
