"""Prefill and decode of different tensor-parallel sizes as real processes: each decode rank gets the KV heads it
holds straight from the prefill rank that holds them (no rank gathers a page), over TCP and NIXL, and the answer
is the one process's answer.

The default model in fp32: its 3 KV-head groups split 2 + 1 over two ranks, so a TP 2 rank and a TP 1 worker
exchange parts of pages both ways.
"""
from __future__ import annotations

import asyncio

import pytest

from procs import children, greedy_in_one_process, start_worker
from test_pd_workers import FP32, QUESTIONS, assert_clean, generate, tokenizer  # noqa: F401 (a fixture)

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS[:3]]


@pytest.fixture(scope="module")
def one_process(default_model_dir, prompts) -> list[list[int]]:
    return greedy_in_one_process(default_model_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("prefill_tp,decode_tp,backend", [(1, 2, "tcp"), (2, 1, "nixl"), (2, 1, "tcp"), (2, 2, "tcp")])
def test_pd_between_tensor_parallel_sizes_answers_as_one_process(prefill_tp, decode_tp, backend, prompts,
                                                                 one_process):
    prefill, paddr = start_worker("prefill", None, *FP32, "--transfer-backend", backend,
                                  "--tp-size", str(prefill_tp))
    decode = None
    try:
        prefill.wait_healthy()
        decode, daddr = start_worker("decode", None, *FP32, "--transfer-backend", backend, "--prefill", paddr,
                                     "--local-prefill-max-tokens", "0", "--tp-size", str(decode_tp))
        decode.wait_healthy()
        for proc, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            engine, = children(proc.popen.pid)
            assert len(children(engine)) == tp - 1  # the other ranks, each a process of its own

        async def run():
            alone = [(await generate(daddr, ids, prefill=paddr, max_new_tokens=NEW_TOKENS))["tokens"][0]
                     for ids in prompts]
            together = await asyncio.gather(*(generate(daddr, ids, prefill=paddr, max_new_tokens=NEW_TOKENS)
                                              for ids in prompts))
            await assert_clean(paddr, daddr)
            return alone, [o["tokens"][0] for o in together]

        alone, together = asyncio.run(run())
        assert alone == one_process
        assert together == one_process
    finally:
        if decode is not None:
            decode.stop()
        prefill.stop()
