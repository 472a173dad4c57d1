"""Prefill and decode workers as real processes, talking gRPC and moving KV over NIXL or TCP.

The default model in fp32, so PD output can be compared token for token with a
colocated worker and with transformers.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto as to_proto
from pdserve.shared.sampling_params import SamplingParams
from procs import start_worker

FP32 = ("--dtype", "float32")
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count from one to ten.",
             "Why do cats purr? Answer in detail with at least three reasons and an example for each."]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


def start_pair(backend: str, *extra: str):
    prefill, paddr = start_worker("prefill", None, *FP32, "--transfer-backend", backend, *extra)
    prefill.wait_healthy()
    # Every prompt goes through the prefill worker, even one whose prefix this decode worker holds: these tests
    # are about that path (test_pd.py covers prompts a decode worker computes itself).
    decode, daddr = start_worker("decode", None, *FP32, "--transfer-backend", backend, "--prefill", paddr,
                                 "--local-prefill-max-tokens", "0", *extra)
    decode.wait_healthy()
    return prefill, paddr, decode, daddr


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def pair(request):
    prefill, paddr, decode, daddr = start_pair(request.param, "--chunked-prefill-size", "32")
    yield paddr, daddr
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def colocated():
    proc, addr = start_worker("colocated", None, *FP32)
    proc.wait_healthy()
    yield addr
    proc.stop()


async def generate(addr: str, ids: list[int], prefill: str = "", timeout: float = 120, **params) -> dict:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_new_tokens", 24)
    request = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling=to_proto(SamplingParams(**params)),
                                 prefill_addr=prefill)
    out: dict = {"tokens": {}, "finish": {}, "cached": 0, "prompt_logprobs": []}
    async with grpc.aio.insecure_channel(addr) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(request, timeout=timeout):
            if msg.prompt_tokens:
                out["cached"] = msg.cached_tokens
            out["prompt_logprobs"] += [(lp.logprob, list(lp.top.token_ids)) for lp in msg.input_logprobs]
            for c in msg.choices:
                out["tokens"].setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason:
                    out["finish"][c.index] = c.finish_reason
    return out


async def stats(addr: str) -> pb.PoolStats:
    async with grpc.aio.insecure_channel(addr) as ch:
        return await pb_grpc.WorkerStub(ch).Stats(pb.Empty(), timeout=10)


async def assert_clean(*addrs: str) -> None:
    """Every page is free or cached (nothing held by a request) and the integrity check holds."""
    deadline = time.monotonic() + 5
    while True:
        reports = [await stats(a) for a in addrs]
        if all(r.integrity_ok and r.used_pages == 0 for r in reports) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    for addr, r in zip(addrs, reports):
        assert r.integrity_ok, f"{addr}: {r.integrity_message}"
        assert r.used_pages == 0, f"{addr} still holds {r.used_pages} pages"


async def test_pd_greedy_equals_colocated_alone_and_concurrent(pair, colocated, prompts):
    paddr, daddr = pair
    want = [(await generate(colocated, ids))["tokens"][0] for ids in prompts]
    alone = [(await generate(daddr, ids, prefill=paddr))["tokens"][0] for ids in prompts]
    assert alone == want
    together = await asyncio.gather(*(generate(daddr, ids, prefill=paddr) for ids in prompts))
    assert [o["tokens"][0] for o in together] == want
    await assert_clean(paddr, daddr)


async def test_pd_prefix_hits_and_long_chunked_prompts(pair, colocated, prompts, tokenizer):
    paddr, daddr = pair
    long_ids = tokenizer.encode(" ".join(f"item {i} is a number." for i in range(60)))  # several 32-token chunks
    first = await generate(daddr, long_ids, prefill=paddr)
    again = await generate(daddr, long_ids, prefill=paddr)
    assert again["cached"] >= len(long_ids) - 32  # prefill served the prompt from its radix cache
    want = (await generate(colocated, long_ids))["tokens"][0]
    assert first["tokens"][0] == again["tokens"][0] == want
    await assert_clean(paddr, daddr)


async def test_pd_greedy_matches_transformers(pair, prompts, default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    paddr, daddr = pair
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = prompts[0]
    want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    got = await generate(daddr, ids, prefill=paddr)
    assert got["tokens"][0] == want[:len(got["tokens"][0])] and len(got["tokens"][0]) >= min(len(want), 8)


async def test_pd_n_choices_share_one_prefill(pair, prompts):
    paddr, daddr = pair
    out = await generate(daddr, prompts[1], prefill=paddr, n=3, temperature=0.8, seed=7, max_new_tokens=12)
    assert sorted(out["tokens"]) == [0, 1, 2] and set(out["finish"]) == {0, 1, 2}
    again = await generate(daddr, prompts[1], prefill=paddr, n=3, temperature=0.8, seed=7, max_new_tokens=12)
    assert again["tokens"] == out["tokens"]  # same seed, same choices
    await assert_clean(paddr, daddr)


async def test_pd_seeded_samples_equal_colocated(pair, colocated, prompts):
    """A seeded choice draws the same uniforms at each output position wherever that position is sampled: the
    prefill worker samples the first token, the decode worker the rest, and the answer is a colocated worker's
    (the decode worker's generator, fresh, once gave the second token the first token's uniform)."""
    paddr, daddr = pair
    params = dict(temperature=0.8, top_p=0.95, frequency_penalty=0.2, seed=42, max_new_tokens=16)
    want = [(await generate(colocated, ids, **params))["tokens"] for ids in prompts]
    got = [(await generate(daddr, ids, prefill=paddr, **params))["tokens"] for ids in prompts]
    assert got == want
    await assert_clean(paddr, daddr)


CITY = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "population": '
        '{"type": "integer", "minimum": 0, "maximum": 99999999}}, "required": ["name", "population"]}')


async def test_pd_constrained_output_equals_colocated_from_the_first_token(pair, colocated, prompts, tokenizer):
    """The prefill worker masks the first token, the decode worker continues the same grammar."""
    import json
    import re

    paddr, daddr = pair
    for constraint in ({"json_schema": CITY}, {"regex": r"[A-Z][a-z]+, [A-Z][a-z]+ and [A-Z][a-z]+\."}):
        want = await generate(colocated, prompts[0], max_new_tokens=48, **constraint)
        got = await generate(daddr, prompts[0], prefill=paddr, max_new_tokens=48, **constraint)
        assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"] == {0: "stop"}
        text = tokenizer.decode(got["tokens"][0], skip_special_tokens=True)
        if "regex" in constraint:
            assert re.fullmatch(constraint["regex"], text), text
        else:
            assert set(json.loads(text)) >= {"name", "population"}, text
    # Sampled, with n forks sharing the compiled grammar: every choice obeys it (a choice cut by max_new_tokens
    # is a prefix of a sentence of the grammar, ending in a comma or part of a word).
    out = await generate(daddr, prompts[1], prefill=paddr, n=3, temperature=1.0, seed=11, max_new_tokens=24,
                         regex=r"(red|green|blue)(, (red|green|blue))*")
    for choice, tokens in out["tokens"].items():
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        pattern = r"(red|green|blue)(, (red|green|blue))*"
        if out["finish"][choice] == "length":
            pattern += r"(, ?(r|re|g|gr|gre|gree|b|bl|blu)?)?"
        else:
            assert out["finish"][choice] == "stop", out["finish"]
        assert re.fullmatch(pattern, text), (out["finish"][choice], text)
    await assert_clean(paddr, daddr)


async def test_pd_prompt_logprobs_come_from_the_prefill_worker(pair, colocated, prompts):
    paddr, daddr = pair
    long_prompt = prompts[3]  # several 32-token chunks on the prefill worker
    asked = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2, max_new_tokens=4)
    want = await generate(colocated, long_prompt, **asked)
    got = await generate(daddr, long_prompt, prefill=paddr, **asked)
    assert len(got["prompt_logprobs"]) == len(long_prompt) - 1
    assert [top for _, top in got["prompt_logprobs"]] == [top for _, top in want["prompt_logprobs"]]
    for (a, _), (b, _) in zip(got["prompt_logprobs"], want["prompt_logprobs"]):
        assert a == pytest.approx(b, abs=1e-3)
    assert got["tokens"] == want["tokens"]
    await assert_clean(paddr, daddr)


async def test_bad_grammar_reaching_a_worker_is_refused(pair):
    paddr, daddr = pair
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(daddr, [1, 2, 3], prefill=paddr, regex="(unclosed")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in info.value.details()
    await assert_clean(paddr, daddr)


async def test_client_cancel_frees_pages_on_both_sides(pair, prompts, tokenizer):
    paddr, daddr = pair
    long_ids = tokenizer.encode(" ".join(f"row {i}: nothing to see." for i in range(120)))
    for delay in (0.05, 1.5):  # during prefill, then during decode
        task = asyncio.ensure_future(generate(daddr, long_ids, prefill=paddr, max_new_tokens=400, ignore_eos=True))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_clean(paddr, daddr)


async def test_abort_rpc_ends_the_stream(pair, prompts):
    paddr, daddr = pair
    request = pb.GenerateRequest(rid="abort-me", input_ids=prompts[2], prefill_addr=paddr,
                                 sampling=to_proto(SamplingParams(temperature=0, max_new_tokens=500, ignore_eos=True)))
    async with grpc.aio.insecure_channel(daddr) as ch:
        stub = pb_grpc.WorkerStub(ch)
        finish = None
        async for msg in stub.Generate(request, timeout=60):
            if msg.choices[0].token_ids and finish is None:
                assert (await stub.Abort(pb.AbortRequest(rid="abort-me"), timeout=5)).found
                finish = "sent"
            if msg.choices[0].finish_reason:
                finish = msg.choices[0].finish_reason
        assert finish == "abort"
    await assert_clean(paddr, daddr)


@pytest.mark.parametrize("prefill_flags, decode_flags, says", [
    (("--page-size", "16"), ("--page-size", "32"), "page_size: prefill has 16, decode has 32"),
    (("--quantization", "w8a8_int8"), (), "quantization: prefill has w8a8_int8, decode has none"),
])
async def test_mismatched_settings_are_refused_at_registration(prefill_flags, decode_flags, says):
    prefill, paddr = start_worker("prefill", None, "--transfer-backend", "tcp", *prefill_flags)
    prefill.wait_healthy()
    try:
        decode, _ = start_worker("decode", None, "--transfer-backend", "tcp", *decode_flags, "--prefill", paddr)
        decode.popen.wait(120)
        assert decode.popen.returncode != 0
        assert says in decode.tail()
    finally:
        prefill.stop()


async def test_decode_killed_mid_decode_fails_fast_and_prefill_frees(prompts):
    prefill, paddr, decode, daddr = start_pair("nixl")
    try:
        task = asyncio.ensure_future(generate(daddr, prompts[3], prefill=paddr, max_new_tokens=2000, ignore_eos=True))
        await asyncio.sleep(3)
        decode.kill()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError):
            await task
        assert time.monotonic() - t0 < 5
        await assert_clean(paddr)
    finally:
        decode.kill()
        prefill.stop()


async def test_prefill_killed_mid_prefill_fails_fast_and_decode_frees(tokenizer):
    prefill, paddr, decode, daddr = start_pair("tcp", "--chunked-prefill-size", "16")
    long_ids = tokenizer.encode(" ".join(f"line {i} of a long document." for i in range(250)))
    try:
        task = asyncio.ensure_future(generate(daddr, long_ids, prefill=paddr))
        await asyncio.sleep(1.0)
        assert (await stats(daddr)).used_pages > 0  # decode reserved the prompt's pages
        prefill.kill()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await task
        assert time.monotonic() - t0 < 5
        assert "prefill" in err.value.details()
        await assert_clean(daddr)
    finally:
        decode.stop()
        prefill.kill()


async def test_aborts_at_every_stage_leave_other_requests_and_pages_intact(pair, prompts, tokenizer):
    """Requests cancelled or aborted while queued, prefilling, transferring and decoding, beside greedy
    requests: those still give their solo output, and no page is left held or written after reuse."""
    paddr, daddr = pair
    def outputs(results: list[dict]) -> list:  # cached-token counts differ with the cache's state
        return [(r["tokens"], r["finish"]) for r in results]

    solo = outputs([await generate(daddr, p, prefill=paddr) for p in prompts[:3]])
    delays = [0.0, 0.01, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.5, 2.5]

    async def doomed(k: int, delay: float) -> None:
        ids = tokenizer.encode(" ".join(f"row {i} of document {k}." for i in range(60 + 20 * k)))
        rid = f"doomed-{k}-{uuid.uuid4().hex}"
        request = pb.GenerateRequest(rid=rid, input_ids=ids, prefill_addr=paddr, sampling=to_proto(
            SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)))
        async with grpc.aio.insecure_channel(daddr) as ch:
            stub = pb_grpc.WorkerStub(ch)
            call = stub.Generate(request, timeout=120)
            if k % 2:  # half of them are cancelled by the client, half aborted by rid
                await asyncio.sleep(delay)
                call.cancel()
                return
            reader = asyncio.ensure_future(call.read())
            await asyncio.sleep(delay)
            await stub.Abort(pb.AbortRequest(rid=rid), timeout=10)
            with contextlib.suppress(grpc.aio.AioRpcError):
                while (await reader) is not grpc.aio.EOF:
                    reader = asyncio.ensure_future(call.read())

    kept = [asyncio.ensure_future(generate(daddr, p, prefill=paddr)) for p in prompts[:3]]
    await asyncio.gather(*(doomed(k, d) for k, d in enumerate(delays)))
    assert outputs([await t for t in kept]) == solo
    again = [await generate(daddr, p, prefill=paddr) for p in prompts[:3]]  # pages reused after the aborts
    assert outputs(again) == solo
    await assert_clean(paddr, daddr)
