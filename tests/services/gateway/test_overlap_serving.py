"""A decode worker that launches each decode step before reading the previous one's tokens
(`--enable-overlap-schedule`, the GPU's default order, forced on a CPU), behind a real gateway and a prefill
worker, asked through the official OpenAI client: answers, lengths, logprobs and n > 1 as a client expects,
streams equal to non-streamed answers, and nothing left behind by finished or abandoned streams."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from harness import pd_pair, wait_idle


@pytest.fixture(scope="module")
def pd_overlap(default_model_dir):
    with pd_pair(default_model_dir, decode_args=("--enable-overlap-schedule",)) as (gw, _, decode, _, decode_addr):
        yield gw, decode, decode_addr


def client_for(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)


def test_the_decode_worker_says_its_steps_overlap(pd_overlap):
    _, decode, _ = pd_overlap
    ready = [line for line in decode.tail(200).splitlines() if "worker ready" in line]
    assert ready and ready[0].endswith("overlapped decode steps"), ready


def test_answers_and_streams_agree(pd_overlap):
    gw, _, _ = pd_overlap
    client = client_for(gw)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="default", messages=question, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="default", messages=question, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_concurrent_requests_get_exact_lengths_logprobs_and_choices(pd_overlap):
    gw, _, decode_addr = pd_overlap
    client = client_for(gw)

    def ask(i: int):
        return client.completions.create(model="default", prompt=f"Count to {i + 3}:", max_tokens=5 + 3 * i,
                                         temperature=0.8, seed=i, n=1 + i % 2, logprobs=2,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for i, r in enumerate(answers):
        assert len(r.choices) == 1 + i % 2
        for choice in r.choices:
            assert choice.finish_reason == "length"
            assert len(choice.logprobs.tokens) == 5 + 3 * i
            assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
        assert r.usage.completion_tokens == (5 + 3 * i) * (1 + i % 2)
    load, stats = wait_idle(decode_addr, timeout=20)
    assert (load.running, stats.used_pages, stats.integrity_ok) == (0, 0, True), stats


def test_abandoned_streams_leave_nothing_behind(pd_overlap):
    gw, _, decode_addr = pd_overlap
    body = {"model": "default", "prompt": "Tell a long story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    for _ in range(3):
        with requests.post(gw.base + "/completions", json=body, stream=True, timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(12)]  # a few tokens in, then the client goes away
            assert any(line.startswith(b"data: ") for line in got)
    load, stats = wait_idle(decode_addr, timeout=20)
    assert (load.running, load.waiting, stats.used_pages, stats.integrity_ok) == (0, 0, 0, True), stats
