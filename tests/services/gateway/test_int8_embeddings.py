"""An embedding worker started with `--quantization w8a8_int8`, behind a real gateway, asked through the
official OpenAI client: vectors within int8's distance of sentence-transformers' fp32 ones, same API; and the
worker's /metrics counting what it was asked."""
from __future__ import annotations

import openai
import pytest
import requests
import torch

from harness import System, start_gateway, start_worker

MINILM = "all-MiniLM-L6-v2"
TEXTS = ["Hello, world!", "SGLang is fast", "The giant panda is a bear species endemic to China.",
         "Giant pandas feed almost entirely on bamboo.", "The stock market fell sharply on Monday."]


@pytest.fixture(scope="module")
def int8_gateway(minilm_dir):
    system = System()
    try:
        proc, addr = start_worker("colocated", MINILM, "--is-embedding", "--quantization", "w8a8_int8", threads=1)
        system.workers[addr] = proc
        gw = start_gateway(minilm_dir, "--worker", addr)
        system.gateways.append(gw)
        proc.wait_healthy(120)
        gw.proc.wait_healthy(60)
        yield gw, proc.health_url.replace("/health", "/metrics")
    finally:
        system.stop()


def test_int8_embeddings_through_the_openai_client(int8_gateway, minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    gw, _ = int8_gateway
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    r = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    got = torch.tensor([d.embedding for d in r.data])
    want = torch.tensor(st.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS))
    cosine = torch.nn.functional.cosine_similarity(got, want)
    assert got.shape == (5, 384) and cosine.min() >= 0.99, cosine
    # Not fp32's answer bit for bit (that would mean the int8 path never ran), but the same neighbours.
    assert cosine.max() < 0.99999
    sims = got @ got.t()
    assert sims[2].topk(2).indices.tolist() == [2, 3]  # the panda sentences find each other
    # Alone, the text is padded differently: attention's float sums move by ~1e-7, enough to flip a rounding to
    # int8 here and there, and the vector moves within int8's own distance from fp32 (not further).
    native = requests.post(gw.url + "/encode", json={"text": TEXTS[0]}, timeout=60).json()
    assert torch.nn.functional.cosine_similarity(torch.tensor(native["embedding"]), got[0], dim=0) >= 0.998


def metric(text: str, name: str) -> float:
    [value] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " ")]
    return value


def test_the_embedding_worker_counts_requests_and_tokens_in_its_metrics(int8_gateway, minilm_dir):
    from transformers import AutoTokenizer

    gw, metrics_url = int8_gateway
    before = requests.get(metrics_url, timeout=10).text
    texts = ["one two three", "a somewhat longer sentence about giant pandas and bamboo"]
    r = requests.post(gw.base + "/embeddings", json={"input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    after = requests.get(metrics_url, timeout=10)
    assert after.status_code == 200 and after.headers["Content-Type"].startswith("text/plain")
    tokens = sum(len(AutoTokenizer.from_pretrained(str(minilm_dir)).encode(t)) for t in texts)
    assert r.json()["usage"]["prompt_tokens"] == tokens
    for name, grew in (("sglang:prompt_tokens_total", tokens), ("sglang:num_requests_total", 1),
                       ("pdserve_worker_encoder_sequences_total", 2),
                       ("sglang:e2e_request_latency_seconds_count", 1)):
        assert metric(after.text, name) - metric(before, name) == grew, name
    assert metric(after.text, "pdserve_worker_encoder_forward_seconds_count") > metric(
        before, "pdserve_worker_encoder_forward_seconds_count")
    assert metric(after.text, "sglang:num_queue_reqs") == 0
