"""Each new model family served by real prefill and decode processes (KV over TCP): greedy tokens equal
transformers' on the same tiny random weights (fp32), with chunked prefill on the prefill worker and, the
second time, the prompt's pages from its prefix cache."""
from __future__ import annotations

import uuid

import grpc
import pytest
import torch

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

NEW_TOKENS = 12
PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 9, 11, 13, 15, 17, 19, 21, 23, 29, 31, 37, 41, 43], [100, 101, 102, 7]]
# qwen3-moe: per-head q/k norm, routed experts with renormalised top-k and a dense middle layer; mixtral: its
# softmax routing; llama3-rope: Llama 3's rope scaling. (Llama, Qwen2 and Qwen2-MoE run PD in other tests.)
FAMILIES = ["qwen3-moe", "mixtral", "llama3-rope"]


def transformers_greedy(model_dir) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]


async def generate(daddr: str, paddr: str, ids: list[int]) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    request = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling=params_to_proto(params),
                                 prefill_addr=paddr)
    tokens, cached = [], 0
    async with grpc.aio.insecure_channel(daddr) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(request, timeout=120):
            cached = max(cached, msg.cached_tokens)
            for choice in msg.choices:
                tokens += choice.token_ids
    return tokens, cached


@pytest.mark.parametrize("family", FAMILIES)
async def test_pd_greedy_matches_transformers_chunked_then_cached(tiny_models, family):
    model = str(tiny_models[family])
    common = ("--dtype", "float32", "--transfer-backend", "tcp", "--page-size", "4")
    prefill, paddr = start_worker("prefill", model, *common, "--chunked-prefill-size", "8")
    decode, daddr = start_worker("decode", model, *common, "--prefill", paddr)
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        want = transformers_greedy(model)
        for attempt in range(2):
            results = [await generate(daddr, paddr, ids) for ids in PROMPTS]
            assert [tokens for tokens, _ in results] == want, f"{family}, attempt {attempt}"
            if attempt == 1:  # the prompt came from the prefill worker's cache to the token, but for its last
                # (always computed, for its logits): its full pages, and the page it leaves part-way copied
                assert [cached for _, cached in results] == [len(p) - 1 for p in PROMPTS]
    finally:
        decode.stop()
        prefill.stop()
