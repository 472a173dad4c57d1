"""A prefill and a decode worker started with `--quantization w8a8_int8` on the default model, behind a real
gateway, asked through the official OpenAI client: the int8 model answers, streams, and says in its start line
what it runs."""
from __future__ import annotations

import pytest

from harness import answers_and_streams, pd_pair

QUANTIZED = ("--quantization", "w8a8_int8")


@pytest.fixture(scope="module")
def pd_int8(default_model_dir):
    with pd_pair(default_model_dir, QUANTIZED, QUANTIZED) as (gw, prefill, decode, _, _):
        yield gw, prefill, decode


def test_the_int8_model_answers_and_streams(pd_int8):
    gw, _, _ = pd_int8
    answers_and_streams(gw)


def test_each_worker_names_its_quantization_when_ready(pd_int8):
    _, prefill, decode = pd_int8
    for proc in (prefill, decode):
        ready = [line for line in proc.tail(200).splitlines() if "worker ready" in line]
        assert ready and "(w8a8_int8), kernels" in ready[0], ready
