"""A prefill and a decode worker serving the default model's shipped Q4_1 GGUF file as stored
(`--quantization gguf`; the default model is that file, converted once for its config and tokenizer) behind a
real gateway, asked through the official OpenAI client: the 4-bit model answers and streams the same tokens,
and each worker says in its start line what it runs."""
from __future__ import annotations

import pytest

from harness import answers_and_streams, pd_pair


@pytest.fixture(scope="module")
def pd_gguf(default_model_dir):
    flags = ("--quantization", "gguf")
    with pd_pair(default_model_dir, flags, flags) as (gw, prefill, decode, _, _):
        yield gw, prefill, decode


def test_the_gguf_model_answers_and_streams(pd_gguf):
    gw, _, _ = pd_gguf
    answers_and_streams(gw)


def test_each_worker_names_its_quantization_when_ready(pd_gguf):
    _, prefill, decode = pd_gguf
    for proc in (prefill, decode):
        ready = [line for line in proc.tail(200).splitlines() if "worker ready" in line]
        assert ready and "(gguf), kernels" in ready[0], ready
