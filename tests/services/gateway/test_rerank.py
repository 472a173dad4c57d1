"""/v1/rerank and /classify through a real gateway and a cross-encoder worker, against transformers.

System: one worker serving a cross-encoder behind a gateway, once for each family: all-MiniLM-L6-v2's BERT
encoder with a seeded one-output head, and a tiny XLM-RoBERTa reranker (bge-reranker-v2-m3's architecture:
positions after the padding id, no segment ids, a dense + out_proj head), see tests/pooling_models.py. The same system shows that the generative endpoints refuse
a model that does not generate, with a 400 that names it.
"""
from __future__ import annotations

import functools

import openai
import pytest
import requests
import torch

from harness import System, start_gateway, start_worker

QUERY = "what is panda?"
DOCS = ["hi", "The giant panda (Ailuropoda melanoleuca), sometimes called a panda bear or simply panda, is a bear "
        "species endemic to China.", "pandas is a Python library for data frames", "Bears eat bamboo."]


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def reranker(request, tmp_path_factory, minilm_dir):
    from pooling_models import make_cross_encoder, make_tiny_xlm_roberta_reranker

    root = tmp_path_factory.mktemp("reranker")
    if request.param == "bert":
        model_dir = make_cross_encoder(minilm_dir, root / "minilm-reranker")
    else:
        model_dir = make_tiny_xlm_roberta_reranker(root / "tiny-xlm-roberta-reranker")
    system = System()
    try:
        proc, addr = start_worker("colocated", str(model_dir), "--is-embedding", threads=1)
        system.workers[addr] = proc
        gw = start_gateway(model_dir, "--worker", addr)
        system.gateways.append(gw)
        proc.wait_healthy(120)
        gw.proc.wait_healthy(60)
        yield model_dir, gw
    finally:
        system.stop()


@functools.cache
def hf(model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return (AutoTokenizer.from_pretrained(str(model_dir)),
            AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval())


def hf_logits(model_dir, first: list[str], second: list[str] | None = None, **tok_args) -> torch.Tensor:
    tok, model = hf(model_dir)
    with torch.no_grad():
        return model(**tok(first, second, padding=True, return_tensors="pt", **tok_args)).logits


def error_of(r: requests.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and body["code"] == status and (param is None or body["param"] == param), body
    return body["message"]


def test_rerank_matches_transformers_best_first(reranker):
    model_dir, gw = reranker
    r = requests.post(gw.base + "/rerank", json={"model": model_dir.name, "query": QUERY, "documents": DOCS},
                      timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    want = torch.sigmoid(hf_logits(model_dir, [QUERY] * len(DOCS), DOCS)[:, 0])
    assert [item["index"] for item in got] == torch.argsort(want, descending=True).tolist()
    assert all(item["document"] == DOCS[item["index"]] for item in got)
    assert torch.allclose(torch.tensor([item["score"] for item in got]), want[[i["index"] for i in got]], atol=1e-5)
    assert max(want) - min(want) > 0.02  # the order is not decided by rounding


def test_rerank_top_n_and_without_documents(reranker):
    _, gw = reranker
    full = requests.post(gw.base + "/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60).json()
    top = requests.post(gw.base + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                                   "return_documents": False}, timeout=60).json()
    assert [(t["index"], t["score"]) for t in top] == [(f["index"], f["score"]) for f in full[:2]]
    assert all("document" not in t for t in top)


def test_rerank_truncates_only_when_asked(reranker):
    model_dir, gw = reranker
    long_doc = "bamboo " * 600
    body = {"query": QUERY, "documents": [long_doc, DOCS[1]]}
    assert "truncate_prompt_tokens" in error_of(requests.post(gw.base + "/rerank", json=body, timeout=60), 400,
                                                "documents.0")
    r = requests.post(gw.base + "/rerank", json={**body, "truncate_prompt_tokens": 64}, timeout=60)
    assert r.status_code == 200, r.text
    want = torch.sigmoid(hf_logits(model_dir, [QUERY] * 2, [long_doc, DOCS[1]], truncation=True,
                                   max_length=64)[:, 0])
    assert torch.allclose(torch.tensor(sorted(i["score"] for i in r.json())), want.sort().values, atol=1e-5)


@pytest.mark.parametrize("body,param", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": "", "documents": ["a"]}, "query"),
    ({"query": QUERY, "documents": ["a", ""]}, "documents.1"),
    ({"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": ["a"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"query": QUERY, "documents": ["a"], "truncate_prompt_tokens": 513}, "truncate_prompt_tokens"),
    ({"documents": ["a"]}, "query"),
])
def test_bad_rerank_requests_are_400s(reranker, body, param):
    error_of(requests.post(reranker[1].base + "/rerank", json=body, timeout=60), 400, param)


def test_classify_answers_the_head_logits(reranker):
    model_dir, gw = reranker
    want = hf_logits(model_dir, DOCS)
    many = requests.post(gw.url + "/classify", json={"model": "default", "text": DOCS}, timeout=60).json()
    assert isinstance(many, list) and len(many) == len(DOCS)
    assert torch.allclose(torch.tensor([m["embedding"] for m in many]), want, atol=1e-5)
    assert [m["meta_info"]["prompt_tokens"] for m in many] == [len(hf(model_dir)[0].encode(d)) for d in DOCS]
    one = requests.post(gw.url + "/classify", json={"text": DOCS[1]}, timeout=60).json()
    assert one["embedding"] == pytest.approx(many[1]["embedding"], abs=1e-6)


def test_a_classifier_refuses_embeddings_and_generation(reranker):
    model_dir, gw = reranker
    message = error_of(requests.post(gw.base + "/embeddings", json={"input": "hi"}, timeout=60), 400, "model")
    assert model_dir.name in message and "/v1/rerank" in message
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "hi"}])
    assert model_dir.name in chat.value.message and "classification model" in chat.value.message
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model="default", prompt="hi", max_tokens=2)
    assert "/v1/completions needs a generative model" in completion.value.message
    message = error_of(requests.post(gw.url + "/generate", json={"text": "hi"}, timeout=60), 400, "model")
    assert model_dir.name in message and "/classify" in message


def test_a_generative_model_refuses_rerank_and_classify(colocated):
    r = requests.post(colocated.open.base + "/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
    assert "SmolLM2-135M-Instruct" in error_of(r, 400, "model")
    r = requests.post(colocated.open.url + "/classify", json={"text": "a"}, timeout=60)
    assert "/v1/chat/completions" in error_of(r, 400, "model")
