"""Speculative decoding served: a colocated worker and a PD pair whose decode worker speculate (ngram), behind
real gateways, asked with the official OpenAI client.

What a user must see: the same greedy answer as without speculation (fp32, where plain and verify steps agree),
streamed in fewer messages than tokens, and the acceptance in the worker's /metrics, the gateway's
/get_server_info and the status page.
"""
from __future__ import annotations

import time

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from harness import System, start_gateway, start_worker

COPY = ("Repeat the following text exactly, word for word:\n\nThe committee met on Tuesday to review the budget. "
        "It approved the new library, the bicycle lanes on Main Street and the repairs to the old bridge.\n"
        "def area(width, height):\n    return width * height\n")
NEW_TOKENS = 60
SPEC = ("--speculative-algorithm", "ngram", "--dtype", "float32")


@pytest.fixture(scope="module")
def served(default_model_dir):
    system = System()
    try:
        colocated, caddr = start_worker("colocated", str(default_model_dir), *SPEC)
        prefill, paddr = start_worker("prefill", str(default_model_dir), "--dtype", "float32",
                                      "--transfer-backend", "tcp")
        decode, daddr = start_worker("decode", str(default_model_dir), *SPEC, "--transfer-backend", "tcp",
                                     "--prefill", paddr)
        system.workers.update({caddr: colocated, paddr: prefill, daddr: decode})
        gateways = {"colocated": start_gateway(default_model_dir, "--worker", caddr),
                    "pd": start_gateway(default_model_dir, "--prefill", paddr, "--decode", daddr)}
        system.gateways += list(gateways.values())
        for proc in (colocated, prefill, decode):
            proc.wait_healthy(240)
        for gw in gateways.values():
            gw.proc.wait_healthy(60)
        yield gateways, {"colocated": colocated, "pd": decode}
    finally:
        system.stop()


@pytest.fixture(scope="module")
def expected(default_model_dir) -> tuple[list[int], str]:
    """The prompt's token ids, and the plain greedy answer of an engine without speculation."""
    from transformers import AutoTokenizer

    from pdserve.shared.config import CacheConfig, RuntimeConfig
    from pdserve.shared.engine import Engine
    from pdserve.shared.req import Req
    from pdserve.shared.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": COPY}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    engine = Engine(RuntimeConfig(model_path=str(default_model_dir), dtype="float32",
                                  cache=CacheConfig(page_size=16, max_total_tokens=4096)))
    out: list[int] = []
    engine.add_request(Req(rid="r", input_ids=ids, on_output=lambda o: out.extend(o.token_ids),
                           params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    return ids, tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_the_answer_is_the_plain_one_in_fewer_messages(served, expected, mode):
    gateways, workers = served
    gw = gateways[mode]
    ids, answer = expected
    c = openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    stream = c.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    pieces, tokens = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert "".join(pieces) == answer
    assert tokens == NEW_TOKENS
    assert len([p for p in pieces if p]) < NEW_TOKENS * 0.7  # several tokens per message where drafts held

    families = {f.name: f for f in text_string_to_metric_families(
        requests.get(workers[mode].health_url.replace("/health", "/metrics"), timeout=30).text)}
    assert families["sglang:spec_accept_length"].samples[0].value > 1.5
    assert 0 < families["sglang:spec_accept_rate"].samples[0].value <= 1
    assert families["sglang:spec_verify_calls"].samples[0].value > 0

    # The gateway reads each worker's load at its health rounds: the totals show within a round or two.
    deadline = time.monotonic() + 10
    while True:
        workers_info = requests.get(gw.url + "/get_server_info", timeout=30).json()["workers"]
        spec = [w["speculative"] for w in workers_info if w["speculative"]]
        if spec or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(spec) == 1 and spec[0]["accepted_tokens"] > 0
    assert all(w["speculative"] is None for w in workers_info if w["role"] == "prefill")
    status = requests.get(gw.url + "/status.json", timeout=30).json()
    shown = [w["spec"] for ws in status["workers"].values() for w in ws if w["spec"]]
    assert len(shown) == 1 and shown[0]["accept_length"] > 1.5


def test_a_stop_string_ends_the_answer_where_plain_decoding_ends_it(served, expected):
    # Drafts run past the stop string within one message; the client still gets the text up to it.
    gateways, _ = served
    ids, answer = expected
    c = openai.OpenAI(base_url=gateways["colocated"].base, api_key="none", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    r = c.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, stop=["bicycle"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == answer[:answer.index("bicycle")]
