"""SGLang's native endpoints through a real gateway and worker, with `requests` and `curl` as users call them."""
from __future__ import annotations

import json
import subprocess
import threading
import time

import requests

from harness import wait_idle

TIMEOUT = 120


def post(gw, path, body, **kw):
    return requests.post(gw.url + path, json=body, headers=gw.headers(), timeout=TIMEOUT, **kw)


def sse_events(response, into: list | None = None) -> list:
    events = [] if into is None else into
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_text_single(colocated):
    r = post(colocated.open, "/generate", {"text": "The capital of France is",
                                           "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                               "ignore_eos": True}})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["prompt_tokens"] == 5 and meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    assert len(meta["id"]) == 32 and out["text"].strip()


def test_generate_defaults_batch_ids_and_n(colocated):
    r = post(colocated.open, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3}}).json()
    assert r["meta_info"]["completion_tokens"] <= 3
    ids = requests.post(colocated.open.url + "/tokenize", json={"prompt": "The capital of France is"}).json()
    batch = post(colocated.open, "/generate", {"input_ids": [ids["tokens"], ids["tokens"][:3]],
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["meta_info"]["prompt_tokens"] == ids["count"] and batch[1]["meta_info"]["prompt_tokens"] == 3
    text = post(colocated.open, "/generate", {"text": "The capital of France is",
                                              "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).json()
    assert text["output_ids"] == batch[0]["output_ids"]
    n = post(colocated.open, "/generate", {"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": 4, "n": 2, "temperature": 1.0, "sampling_seed": 1}}).json()
    assert isinstance(n, list) and len(n) == 2


def test_generate_stream_is_cumulative_and_ends_with_done(colocated):
    body = {"text": "The capital of France is", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    with post(colocated.open, "/generate", body, stream=True) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    whole = post(colocated.open, "/generate", {**body, "stream": False}).json()
    assert chunks[-1]["text"] == whole["text"]


def test_generate_stream_interval_groups_tokens(colocated):
    body = {"text": "The capital of France is", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "stream_interval": 4}}
    with post(colocated.open, "/generate", body, stream=True) as r:
        chunks = sse_events(r)[:-1]
    counts = [len(c["output_ids"]) for c in chunks]
    assert counts[-1] == 10 and len(counts) <= 3  # every 4 tokens (or more, when they arrive together), the end
    assert all(b - a >= 4 for a, b in zip([0] + counts[:-2], counts[:-1]))
    bad = post(colocated.open, "/generate", {**body, "sampling_params": {"stream_interval": 0}})
    assert bad.status_code == 400 and bad.json()["param"] == "sampling_params.stream_interval"


def test_generate_prompt_logprobs_from_logprob_start_len(colocated):
    body = {"text": "The capital of France is", "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    whole = post(colocated.open, "/generate", {**body, "logprob_start_len": 0}).json()["meta_info"]
    prompt = whole["input_token_logprobs"]
    assert len(prompt) == whole["prompt_tokens"] and prompt[0][0] is None and prompt[0][2] == "The"
    assert all(lp <= 0 for lp, _, _ in prompt[1:]) and whole["input_top_logprobs"][0] is None
    assert all(len(top) == 2 and top[0][0] >= lp for top, (lp, _, _) in zip(whole["input_top_logprobs"][1:],
                                                                            prompt[1:]))
    tail = post(colocated.open, "/generate", {**body, "logprob_start_len": 3}).json()["meta_info"]
    assert tail["input_token_logprobs"] == prompt[3:]  # the same values, whatever the cache held
    none = post(colocated.open, "/generate", body).json()["meta_info"]
    assert "input_token_logprobs" not in none


def test_generate_logprobs_and_stop_string(colocated):
    r = post(colocated.open, "/generate", {"text": "Count: 1, 2, 3, 4,", "return_logprob": True,
                                           "top_logprobs_num": 2, "return_text_in_logprobs": True,
                                           "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                               "stop": [" 7"]}}).json()
    meta = r["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": " 7"}
    assert " 7" not in r["text"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(r["output_ids"])
    logprob, token_id, text = meta["output_token_logprobs"][0]
    assert logprob <= 0 and token_id == r["output_ids"][0] and isinstance(text, str)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_model_and_server_info(colocated, default_model_dir):
    info = requests.get(colocated.open.url + "/get_model_info").json()
    assert set(info) == {"model_path", "is_generation", "tokenizer_path", "preferred_sampling_params",
                         "weight_version", "has_image_understanding", "has_audio_understanding", "model_type",
                         "architectures"}
    assert info["model_path"] == str(default_model_dir) and info["is_generation"] is True
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    server = requests.get(colocated.open.url + "/get_server_info").json()
    assert server["port"] == int(colocated.open.url.rsplit(":", 1)[1]) and "api_key" not in server
    assert server["max_total_num_tokens"] == 8192 and server["context_length"] == 8192
    assert [(w["address"], w["role"], w["healthy"]) for w in server["workers"]] == \
        [(colocated.worker, "colocated", True)]


def test_health_endpoints(colocated):
    assert requests.get(colocated.open.url + "/health").status_code == 200
    assert requests.get(colocated.open.url + "/health_generate", timeout=TIMEOUT).status_code == 200
    # A gateway whose worker is down is not ready, but alive: an orchestrator must not restart it for that.
    assert requests.get(colocated.dead.url + "/health", timeout=TIMEOUT).status_code == 503
    assert requests.get(colocated.dead.url + "/live", timeout=TIMEOUT).status_code == 200
    assert requests.get(colocated.secured.url + "/live", timeout=TIMEOUT).status_code == 200  # no key needed


def test_flush_cache_empties_the_worker_cache(colocated):
    post(colocated.open, "/generate", {"text": "Fill the cache with a prompt " * 8,
                                       "sampling_params": {"max_new_tokens": 1}})
    wait_idle(colocated.worker)
    from harness import worker_call

    assert worker_call(colocated.worker, "Stats").cached_pages > 0
    r = requests.post(colocated.open.url + "/flush_cache", headers=colocated.open.admin_headers())
    assert r.status_code == 200 and "Cache flushed" in r.text
    assert worker_call(colocated.worker, "Stats").cached_pages == 0


def test_tokenize_detokenize_round_trip(colocated):
    text = "SGLang provides efficient tokenization endpoints. 🤖"
    t = post(colocated.open, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 8192
    assert post(colocated.open, "/detokenize", {"tokens": t["tokens"]}).json() == {"text": text}
    many = post(colocated.open, "/tokenize", {"prompt": ["a b", "c"]}).json()
    assert many["count"] == [len(x) for x in many["tokens"]]
    assert post(colocated.open, "/detokenize", {"tokens": many["tokens"]}).json()["text"] == ["a b", "c"]


def test_abort_request_ends_a_running_generation(colocated):
    body = {"text": "Tell me a long story", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    events: list = []

    def consume():
        with post(colocated.open, "/generate", body, stream=True) as r:
            sse_events(r, into=events)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 60
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    r = requests.post(colocated.open.url + "/abort_request", json={"rid": "abort-me"},
                      headers=colocated.open.admin_headers(), timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["aborted"] == ["abort-me"]
    t.join(30)
    assert not t.is_alive()
    last = events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400
    load, stats = wait_idle(colocated.worker)
    assert (load.running, stats.used_pages, stats.integrity_ok) == (0, 0, True)


def test_metrics_count_requests_and_latencies(colocated):
    post(colocated.open, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    requests.get(colocated.open.url + "/no/such/route")
    text = requests.get(colocated.open.url + "/metrics").text
    assert 'pdserve_gateway_requests_total{route="/generate",status="200"}' in text
    assert 'pdserve_gateway_requests_total{route="unmatched",status="404"}' in text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        count = next(line for line in text.splitlines() if line.startswith(f"pdserve_gateway_{name}_count"))
        assert float(count.split()[-1]) > 0
    assert "pdserve_gateway_queued_requests 0.0" in text
    assert float(next(line for line in text.splitlines()
                      if line.startswith("pdserve_gateway_generation_tokens_total")).split()[-1]) >= 3
    assert f'pdserve_gateway_worker_healthy{{address="{colocated.worker}",role="colocated"}} 1.0' in text


def test_curl_chat_stream_and_generate(colocated):
    url = colocated.open.url
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "temperature": 0, "max_tokens": 32, "stream": True})
    out = subprocess.run(["curl", "-sS", "-N", f"{url}/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=TIMEOUT, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1])
    assert "Paris" in text
    out = subprocess.run(["curl", "-sS", f"{url}/generate", "-H", "Content-Type: application/json", "-d",
                          json.dumps({"text": "What is the capital of France?", "sampling_params": {"max_new_tokens": 8}})],
                         capture_output=True, text=True, timeout=TIMEOUT, check=True).stdout
    assert json.loads(out)["meta_info"]["completion_tokens"] > 0
