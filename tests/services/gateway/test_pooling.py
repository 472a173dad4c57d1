"""/v1/score, /v1/embeddings and /encode through real gateways and workers, against transformers and
sentence-transformers on the same weights.

Systems: the suite's colocated SmolLM2 worker (scores on the default model); one embedding worker
(all-MiniLM-L6-v2, started by itself as an encoder) behind a gateway; one tiny-Llama prefill + decode
pair behind a gateway, to show that scoring never touches the decode worker.
"""
from __future__ import annotations

import base64
import functools
import math
import struct

import grpc
import openai
import pytest
import requests
import torch

from harness import System, pd_pair, start_gateway, start_worker, worker_call
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc

TEXTS = ["Hello, world!", "SGLang is fast", "The giant panda is a bear species endemic to China."]


@functools.cache
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_next_token_logprobs(model_dir, seqs: list[list[int]]) -> torch.Tensor:
    model = hf_model(model_dir)
    with torch.no_grad():
        return torch.stack([torch.log_softmax(model(torch.tensor([s])).logits[0, -1].float(), -1) for s in seqs])


def error_of(r: requests.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and body["code"] == status
    if param is not None:
        assert body["param"] == param, body
    return body["message"]


# ---------------------------------------------------------------- embeddings
@pytest.fixture(scope="module")
def embedding(minilm_dir):
    model_dir = minilm_dir
    system = System()
    try:
        proc, addr = start_worker("colocated", str(model_dir), threads=1)  # no --is-embedding: found by itself
        system.workers[addr] = proc
        gw = start_gateway(model_dir, "--worker", addr)
        system.gateways.append(gw)
        proc.wait_healthy(120)
        gw.proc.wait_healthy(60)
        yield model_dir, gw, addr
    finally:
        system.stop()


@pytest.fixture(scope="module")
def st_vectors(embedding):
    st = pytest.importorskip("sentence_transformers")
    return torch.tensor(st.SentenceTransformer(str(embedding[0]), device="cpu").encode(TEXTS))


@pytest.mark.parametrize("encoding_format", [openai.NOT_GIVEN, "float", "base64"])
def test_embeddings_match_sentence_transformers(embedding, st_vectors, encoding_format):
    model_dir, gw, _ = embedding
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, encoding_format=encoding_format)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "all-MiniLM-L6-v2"
    # Asked for explicitly, base64 reaches the caller as sent; left out, the client asks for it and decodes it.
    got = torch.tensor([unpack(d.embedding) if isinstance(d.embedding, str) else d.embedding for d in r.data])
    assert got.shape == (3, 384) and (encoding_format != "base64" or isinstance(r.data[0].embedding, str))
    assert torch.nn.functional.cosine_similarity(got, st_vectors).min() >= 0.9999
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tok.encode(t)) for t in TEXTS)


def unpack(packed: str) -> list[float]:
    raw = base64.b64decode(packed)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_base64_is_little_endian_float32(embedding):
    _, gw, _ = embedding
    body = {"input": TEXTS[0], "encoding_format": "base64"}
    packed = requests.post(gw.base + "/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    floats = requests.post(gw.base + "/embeddings", json={"input": TEXTS[0]}, timeout=60).json()["data"][0]
    assert unpack(packed) == pytest.approx(floats["embedding"], abs=1e-7)


def test_token_ids_and_native_encode_give_the_same_vectors(embedding, st_vectors):
    model_dir, gw, _ = embedding
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(str(model_dir)).encode(t) for t in TEXTS]
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    one = client.embeddings.create(model="default", input=ids[1], encoding_format="float").data
    assert len(one) == 1 and torch.nn.functional.cosine_similarity(
        torch.tensor(one[0].embedding), st_vectors[1], dim=0) >= 0.9999
    many = client.embeddings.create(model="default", input=ids, encoding_format="float").data
    assert torch.nn.functional.cosine_similarity(torch.tensor([d.embedding for d in many]), st_vectors).min() >= 0.9999
    single = requests.post(gw.url + "/encode", json={"text": TEXTS[2]}, timeout=60).json()
    assert single["meta_info"]["prompt_tokens"] == len(ids[2])
    assert torch.nn.functional.cosine_similarity(torch.tensor(single["embedding"]), st_vectors[2], dim=0) >= 0.9999
    batch = requests.post(gw.url + "/encode", json={"input_ids": ids[:2]}, timeout=60).json()
    assert [len(b["embedding"]) for b in batch] == [384, 384]


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", "at least one"),
    ({"input": [[101, 102], []]}, "input.1", "empty"),
    ({"input": "word " * 600}, "input", "context length of 512"),
    ({"input": [5, 40000]}, "input", "outside the vocabulary"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "int8"),
    ({"input": "x", "dimensions": 1024}, "dimensions", "384"),
    ({"input": "x", "dimensions": 128}, "dimensions", "Matryoshka"),
    # SGLang's refusal of a text with nothing to embed, in its words
    ({"input": ""}, "input", "Input cannot be empty or whitespace only"),
    ({"input": ["a", " \n"]}, "input.1", "Input at index 1 cannot be empty or whitespace only"),
])
def test_bad_embedding_requests_are_400s(embedding, body, param, words):
    _, gw, _ = embedding
    r = requests.post(gw.base + "/embeddings", json=body, timeout=60)
    assert words in error_of(r, 400, param)


def test_an_empty_string_is_a_bad_request_for_the_openai_client_and_any_model_name_is_served(embedding):
    _, gw, _ = embedding
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="any-name", input="")
    assert err.value.status_code == 400
    assert len(client.embeddings.create(model="any-name", input="x").data[0].embedding) == 384


def test_truncation_only_when_asked(embedding):
    st = pytest.importorskip("sentence_transformers")
    model_dir, gw, _ = embedding
    text = "The giant panda is a bear species endemic to China. " * 60  # ~720 tokens: over the 512 limit
    r = requests.post(gw.base + "/embeddings", json={"input": text}, timeout=60)
    assert "context length of 512" in error_of(r, 400, "input")
    reference = st.SentenceTransformer(str(model_dir), device="cpu")
    for k in (16, -1):  # -1: as much as the context holds
        reference.max_seq_length = 512 if k == -1 else k
        want = torch.tensor(reference.encode([text]))
        r = requests.post(gw.base + "/embeddings", json={"input": [text], "truncate_prompt_tokens": k}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == (512 if k == -1 else k)
        got = torch.tensor([r.json()["data"][0]["embedding"]])
        assert torch.nn.functional.cosine_similarity(got, want).item() >= 0.9999
    ids = list(range(1000, 1100))  # token ids keep their first k
    cut = requests.post(gw.url + "/encode", json={"input_ids": ids, "truncate_prompt_tokens": 10}, timeout=60).json()
    whole = requests.post(gw.url + "/encode", json={"input_ids": ids[:10]}, timeout=60).json()
    assert cut["meta_info"]["prompt_tokens"] == 10 and cut["embedding"] == pytest.approx(whole["embedding"], abs=1e-6)
    for bad in (0, -2, 513):
        r = requests.post(gw.base + "/embeddings", json={"input": "x", "truncate_prompt_tokens": bad}, timeout=60)
        error_of(r, 400, "truncate_prompt_tokens")


def test_an_embedding_model_refuses_generation(embedding):
    _, gw, _ = embedding
    client = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
    assert "all-MiniLM-L6-v2" in exc.value.message and "embedding model" in exc.value.message
    assert "/v1/embeddings" in exc.value.message


def test_an_embedding_model_refuses_generative_endpoints(embedding):
    _, gw, _ = embedding
    r = requests.post(gw.base + "/score", json={"query": "a", "items": ["b"], "label_token_ids": [1]}, timeout=60)
    assert "all-MiniLM-L6-v2" in error_of(r, 400, "model") and "/v1/embeddings" in r.json()["message"]


def test_a_generative_model_refuses_embeddings(colocated):
    r = requests.post(colocated.open.base + "/embeddings", json={"input": "hello"}, timeout=60)
    message = error_of(r, 400, "model")
    assert "SmolLM2-135M-Instruct" in message and "generative" in message


# ---------------------------------------------------------------- scores on the default model
def test_scores_on_the_default_model_match_transformers(colocated, default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    query, items = "The capital of France is", [" Paris", " London", " Berlin"]
    labels = [tok.encode(" Yes")[0], tok.encode(" No")[0], tok.encode(".")[0]]
    want = hf_next_token_logprobs(default_model_dir, [tok.encode(query + item) for item in items])[:, labels]
    url = colocated.open.base + "/score"
    raw = requests.post(url, json={"query": query, "items": items, "label_token_ids": labels}, timeout=60).json()
    assert raw["object"] == "scoring" and raw["usage"]["prompt_tokens"] == sum(
        len(tok.encode(query + i)) for i in items)
    # The worker computes in bf16, the reference in fp32 on the same (bf16) weights: probabilities agree to ~0.01.
    assert torch.allclose(torch.tensor(raw["scores"], dtype=torch.float32), want.exp(), atol=0.03)
    assert raw["scores"][0][2] > 0.5  # "." is the likely label: the comparison is not between two zeros
    soft = requests.post(url, json={"query": query, "items": items, "label_token_ids": labels,
                                    "apply_softmax": True}, timeout=60).json()["scores"]
    assert torch.allclose(torch.tensor(soft), torch.softmax(want, -1), atol=0.02)
    assert all(math.isclose(sum(row), 1.0, abs_tol=1e-6) for row in soft)


def test_token_id_scores_with_item_first(colocated, default_model_dir):
    query, item, labels = [504, 3575, 282, 4649], [15, 16, 17], [30, 31]
    r = requests.post(colocated.open.base + "/score", json={"query": query, "items": [item], "label_token_ids": labels,
                                                           "item_first": True, "model": "default"}, timeout=60)
    assert r.status_code == 200, r.text
    want = hf_next_token_logprobs(default_model_dir, [item + query])[:, labels]
    assert torch.allclose(torch.tensor(r.json()["scores"], dtype=torch.float32), want.exp(), atol=0.01)


@pytest.mark.parametrize("body,param", [
    ({"query": "a", "items": [], "label_token_ids": [1]}, "items"),
    ({"query": "a", "items": ["b"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "a", "items": ["b"], "label_token_ids": [10 ** 6]}, "label_token_ids"),
    ({"query": "a", "items": [[1, 2]], "label_token_ids": [1]}, "items.0"),
    ({"query": "a", "items": ["b " * 9000], "label_token_ids": [1]}, "items.0"),
    ({"items": ["b"], "label_token_ids": [1]}, "query"),
])
def test_bad_score_requests_are_400s(colocated, body, param):
    error_of(requests.post(colocated.open.base + "/score", json=body, timeout=60), 400, param)


# ---------------------------------------------------------------- PD: scores never reach decode
@pytest.fixture(scope="module")
def tiny_pd(tiny_models):
    model = tiny_models["llama"]
    flags = ("--model-path", str(model), "--transfer-backend", "tcp", "--page-size", "4")
    with pd_pair(model, flags, flags) as (gw, _, _, paddr, daddr):
        yield model, gw, paddr, daddr


def test_pd_scores_come_from_prefill_alone(tiny_pd):
    model, gw, paddr, daddr = tiny_pd
    query, items, labels = [5, 17, 99, 3, 250, 8, 8, 41, 300], [[7, 9], [100, 101, 102], [3]], [7, 9, 300]
    want = hf_next_token_logprobs(model, [query + item for item in items])[:, labels]
    for _ in range(2):  # the second time the query comes from the prefill worker's prefix cache
        r = requests.post(gw.base + "/score", json={"query": query, "items": items, "label_token_ids": labels},
                          timeout=60)
        assert r.status_code == 200, r.text
        assert torch.allclose(torch.tensor(r.json()["scores"]).log(), want, atol=1e-4)
    prefill, decode = worker_call(paddr, "Stats"), worker_call(daddr, "Stats")
    assert prefill.integrity_ok and prefill.used_pages == 0 and prefill.cached_pages > 0
    assert decode.integrity_ok and decode.used_pages == 0 and decode.cached_pages == 0
    with grpc.insecure_channel(daddr) as ch, pytest.raises(grpc.RpcError) as exc:
        pb_grpc.PoolingStub(ch).Encode(pb.EncodeRequest(inputs=[pb.TokenSeq(ids=query)], label_token_ids=labels),
                                       timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
