"""One gateway, two models: a generative model on its runtime worker and a dedicated embedding worker beside
it (`--embedding-model`, as `pdserve up --embedding-model` starts it). Requests pick a model by `model`.

System: a tiny random Llama (colocated) and all-MiniLM-L6-v2 (encoder worker) behind one gateway.
"""
from __future__ import annotations

import time

import grpc
import openai
import pytest
import requests
import torch

from harness import System, start_gateway, start_worker
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc

MINILM = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def two_models(tiny_models, minilm_dir):
    llama = tiny_models["llama"]
    system = System()
    try:
        gen, gen_addr = start_worker("colocated", str(llama), "--page-size", "4")
        emb, emb_addr = start_worker("colocated", MINILM, "--is-embedding")
        system.workers.update({gen_addr: gen, emb_addr: emb})
        gw = start_gateway(llama, "--worker", gen_addr, "--embedding-model", MINILM, "--embedding-worker", emb_addr)
        system.gateways.append(gw)
        for proc in (gen, emb, gw.proc):  # generous: two workers load at once on a busy 2-core machine
            proc.wait_healthy(240)
        # The gateway is healthy once its own model's worker is; the embedding worker joins at its next round.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and requests.post(
                gw.url + "/encode", json={"model": MINILM, "text": "ready?"}, timeout=60).status_code != 200:
            time.sleep(0.5)
        yield llama, minilm_dir, gw
    finally:
        system.stop()


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=60)


def test_models_lists_every_served_model(two_models):
    llama, _, gw = two_models
    models = client(gw).models.list().data
    assert [m.id for m in models] == [str(llama), MINILM]
    assert client(gw).models.retrieve(MINILM).id == MINILM
    assert requests.get(gw.base + "/models/" + MINILM, timeout=10).json()["max_model_len"] == 512


def test_each_request_goes_to_the_model_it_names(two_models):
    llama, minilm_dir, gw = two_models
    st = pytest.importorskip("sentence_transformers")
    texts = ["Hello, world!", "The giant panda is a bear species endemic to China."]
    r = client(gw).embeddings.create(model=MINILM, input=texts, encoding_format="float")
    want = torch.tensor(st.SentenceTransformer(str(minilm_dir), device="cpu").encode(texts))
    got = torch.tensor([d.embedding for d in r.data])
    assert r.model == MINILM and torch.nn.functional.cosine_similarity(got, want).min() >= 0.9999
    out = client(gw).completions.create(model=str(llama), prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    native = requests.post(gw.url + "/encode", json={"model": MINILM, "text": texts[0]}, timeout=60).json()
    assert torch.nn.functional.cosine_similarity(torch.tensor(native["embedding"]), want[0], dim=0) >= 0.9999


def test_a_request_for_the_other_kind_of_model_is_a_400_naming_it(two_models):
    llama, _, gw = two_models
    with pytest.raises(openai.BadRequestError) as chat:
        client(gw).chat.completions.create(model=MINILM, messages=[{"role": "user", "content": "hi"}])
    assert MINILM in chat.value.message and "embedding model" in chat.value.message
    # No model named: the gateway's own (generative) model, which has no embeddings.
    with pytest.raises(openai.BadRequestError) as emb:
        client(gw).embeddings.create(model="default", input="hi")
    assert str(llama) in emb.value.message and "generative model" in emb.value.message
    # A name nothing serves (no --served-model-name): the model of the kind the endpoint needs, as SGLang's one
    # model would serve it
    unknown = client(gw).embeddings.create(model="text-embedding-3-small", input="hi")
    assert len(unknown.data[0].embedding) == 384


def test_an_embedding_worker_is_listed_and_keeps_its_role(two_models):
    llama, _, gw = two_models
    listed = requests.get(gw.url + "/workers", headers=gw.admin_headers(), timeout=30).json()["workers"]
    assert sorted((w["model_id"], w["worker_type"]) for w in listed) == sorted([(str(llama), "regular"),
                                                                                (MINILM, "regular")])
    embedding = next(w["url"] for w in listed if w["model_id"] == MINILM)
    r = requests.post(gw.url + "/workers/switch_role", json={"url": embedding, "worker_type": "prefill"},
                      headers=gw.admin_headers(), timeout=30)
    assert r.status_code == 400 and "(reason: embedding_worker)" in r.json()["message"], r.text
    # The encoder worker refuses by itself too, to a caller that does not check first.
    with grpc.insecure_channel(embedding) as ch, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.WorkerStub(ch).SwitchRole(pb.SwitchRoleRequest(role="prefill"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().startswith("embedding_worker:")
