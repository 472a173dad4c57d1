"""A prefill and a decode worker started with `--quantization w8a8_int8` on the default model, behind a real
gateway, asked through the official OpenAI client: the int8 model answers, streams, and says in its start line
what it runs."""
from __future__ import annotations

import openai
import pytest

from harness import pd_pair

QUANTIZED = ("--quantization", "w8a8_int8")


@pytest.fixture(scope="module")
def pd_int8(default_model_dir):
    with pd_pair(default_model_dir, QUANTIZED, QUANTIZED) as (gw, prefill, decode, _, _):
        yield gw, prefill, decode


def test_the_int8_model_answers_and_streams(pd_int8):
    gw, _, _ = pd_int8
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content  # same greedy tokens, streamed or not


def test_each_worker_names_its_quantization_when_ready(pd_int8):
    _, prefill, decode = pd_int8
    for proc in (prefill, decode):
        ready = [line for line in proc.tail(200).splitlines() if "worker ready" in line]
        assert ready and "(w8a8_int8), kernels" in ready[0], ready
