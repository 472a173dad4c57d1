"""A prefill and a decode worker serving the default model's shipped Q4_1 GGUF file as stored
(`--quantization gguf`; the default model is that file, converted once for its config and tokenizer) behind a
real gateway, asked through the official OpenAI client: the 4-bit model answers and streams the same tokens,
and each worker says in its start line what it runs."""
from __future__ import annotations

import openai
import pytest

from harness import pd_pair


@pytest.fixture(scope="module")
def pd_gguf(default_model_dir):
    flags = ("--quantization", "gguf")
    with pd_pair(default_model_dir, flags, flags) as (gw, prefill, decode, _, _):
        yield gw, prefill, decode


def test_the_gguf_model_answers_and_streams(pd_gguf):
    gw, _, _ = pd_gguf
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content


def test_each_worker_names_its_quantization_when_ready(pd_gguf):
    _, prefill, decode = pd_gguf
    for proc in (prefill, decode):
        ready = [line for line in proc.tail(200).splitlines() if "worker ready" in line]
        assert ready and "(gguf), kernels" in ready[0], ready
