"""Pooling decoders behind a gateway: a reward model (LlamaForSequenceClassification) as the primary model
answering /classify, and a bare Qwen2 embedding checkpoint beside it answering /v1/embeddings, each on its own
colocated worker; checked against transformers on the same tiny random weights."""
from __future__ import annotations

import time

import openai
import pytest
import requests
import torch

from harness import System, start_gateway, start_worker
from pooling_models import make_tiny_decoder_embedder, make_tiny_reward_model

TEXTS = ["What is the capital of France? The capital of France is Paris.", "one two three", "Hello!"]


@pytest.fixture(scope="module")
def pooling_decoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling-decoders")
    reward, embedder = make_tiny_reward_model(root / "reward"), make_tiny_decoder_embedder(root / "embedder")
    system = System()
    try:
        rm, rm_addr = start_worker("colocated", str(reward), "--dtype", "float32", "--page-size", "4")
        emb, emb_addr = start_worker("colocated", str(embedder), "--dtype", "float32", "--is-embedding")
        system.workers.update({rm_addr: rm, emb_addr: emb})
        gw = start_gateway(reward, "--worker", rm_addr, "--served-model-name", "reward",
                           "--embedding-model", str(embedder), "--embedding-served-model-name", "embedder",
                           "--embedding-worker", emb_addr)
        system.gateways.append(gw)
        for proc in (rm, emb, gw.proc):
            proc.wait_healthy(240)
        # The gateway's /health speaks for its primary model only, and it checks workers once a second: the
        # embedding worker may be up a moment before the gateway has seen it.
        deadline = time.monotonic() + 30
        while requests.post(gw.url + "/v1/embeddings", json={"model": "embedder", "input": "x"},
                            timeout=30).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield reward, embedder, gw
    finally:
        system.stop()


def test_reward_model_scores_match_transformers(pooling_decoders):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward, _, gw = pooling_decoders
    r = requests.post(gw.url + "/classify", json={"model": "reward", "text": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(reward)
    hf = AutoModelForSequenceClassification.from_pretrained(reward, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(torch.tensor([tok(t)["input_ids"]])).logits[0].tolist() for t in TEXTS]
    got = [item["embedding"] for item in r.json()]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
    info = requests.get(gw.url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is False and info["architectures"] == ["LlamaForSequenceClassification"]


def test_decoder_embeddings_through_the_openai_client(pooling_decoders):
    from transformers import AutoModel, AutoTokenizer

    _, embedder, gw = pooling_decoders
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    out = client.embeddings.create(model="embedder", input=TEXTS)
    tok = AutoTokenizer.from_pretrained(embedder)
    hf = AutoModel.from_pretrained(embedder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([torch.nn.functional.normalize(
            hf(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0, -1], dim=-1) for t in TEXTS])
    got = torch.tensor([d.embedding for d in out.data])
    assert torch.allclose(got, want, atol=1e-4)
    assert out.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)


def test_pooling_decoders_do_not_generate(pooling_decoders):
    _, _, gw = pooling_decoders
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    for model in ("reward", "embedder"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert model in str(err.value) and "/v1/chat/completions" in str(err.value)
