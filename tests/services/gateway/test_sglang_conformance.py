"""SGLang's HTTP surface as a client written against SGLang meets it: its routes, fields and statuses, and the
words of its errors where a client matches on them, against the live colocated stack (the cases that pass
through prefill and decode workers are in test_pd.py).

- `GET /server_info` beside `/get_server_info`; `/v1/tokenize` and `/v1/detokenize` beside the bare routes.
- `/v1/tokenize` takes a `prompt` or chat `messages`, rendered as a chat completion renders them.
- `model`: any name is served without --served-model-name; with it, another name is a 400.
- A length the context cannot hold is a 400 in SGLang's words, not capped silently (Responses caps, as SGLang).
- /v1/responses errors come in OpenAI's `{"error": {...}}` envelope; /v1/score's carry SGLang's type.
- /detokenize of an id outside the vocabulary stays a 400 (SGLang answers 500).
- `cached_tokens` counts every token a prompt shares with the cache, as SGLang's page size of 1 does.
"""
from __future__ import annotations

import random

import openai
import pytest
import requests

from harness import System, start_gateway

NAME = "served-x"
USER = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
# ChatML that writes the tools into the prompt (the default model's own template ignores them).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def named(colocated, default_model_dir, tmp_path_factory):
    """A gateway started with --served-model-name (and a template that renders tools) on the shared worker."""
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    system = System()
    try:
        gw = start_gateway(default_model_dir, "--worker", colocated.worker, "--served-model-name", NAME,
                           "--chat-template", str(template))
        system.gateways.append(gw)
        gw.proc.wait_healthy(60)
        yield gw
    finally:
        system.stop()


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=120)


def post(gw, path: str, body: dict) -> requests.Response:
    return requests.post(gw.url + path, json=body, timeout=60)


def cached_tokens(gw, input_ids: list[int]) -> int:
    r = post(gw, "/generate", {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def fresh_prompt(seed: int, n: int = 37) -> list[int]:
    """Token ids no other test sends, so the cache holds only what this test put there."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def context_length(gw) -> int:
    return requests.get(gw.url + "/server_info", timeout=30).json()["context_length"]


def test_server_info_answers_under_sglangs_current_name(colocated):
    old = requests.get(colocated.open.url + "/get_server_info", timeout=30)
    new = requests.get(colocated.open.url + "/server_info", timeout=30)
    assert new.status_code == old.status_code == 200
    assert new.json().keys() == old.json().keys()
    assert {k: new.json()[k] for k in ("context_length", "served_model_name", "mode")} == \
        {k: old.json()[k] for k in ("context_length", "served_model_name", "mode")}


def test_v1_tokenize_counts_the_prompt_a_chat_completion_of_the_messages_runs(named):
    def tokenize(**body) -> dict:
        r = post(named, "/v1/tokenize", body)
        assert r.status_code == 200, r.text
        assert r.json().keys() == {"tokens", "count", "max_model_len"}
        return r.json()

    def charged(**extra) -> int:
        return client(named).chat.completions.create(model=NAME, messages=USER, max_tokens=1, temperature=0,
                                                     **extra).usage.prompt_tokens

    plain = tokenize(messages=USER)
    assert plain["count"] == len(plain["tokens"]) == charged() and plain["max_model_len"] == context_length(named)
    with_tools = tokenize(messages=USER, tools=TOOLS)
    assert with_tools["count"] > plain["count"] and with_tools["count"] == charged(tools=TOOLS)
    assert tokenize(messages=USER, tools=TOOLS, tool_choice="none")["tokens"] == plain["tokens"]


def test_v1_tokenize_and_detokenize_take_prompts_as_the_bare_routes(colocated):
    text = "SGLang provides efficient tokenization endpoints."
    one = post(colocated.open, "/v1/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert one == post(colocated.open, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert one["count"] == len(one["tokens"]) > 0
    assert post(colocated.open, "/v1/detokenize", {"tokens": one["tokens"]}).json() == {"text": text}
    many = post(colocated.open, "/v1/tokenize", {"prompt": ["a b", "c"]}).json()
    assert many["count"] == [len(t) for t in many["tokens"]]
    for body in ({"prompt": text, "messages": USER}, {}):
        r = post(colocated.open, "/v1/tokenize", body)
        assert r.status_code == 400 and "Exactly one of 'prompt' or 'messages'" in r.json()["message"], r.text


def test_detokenize_of_an_id_outside_the_vocabulary_stays_a_400(colocated):
    for path in ("/detokenize", "/v1/detokenize"):
        r = post(colocated.open, path, {"tokens": [1, 10**9]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["message"], r.text


def test_cached_tokens_count_every_shared_token_not_whole_pages(colocated):
    ids = fresh_prompt(59)
    assert cached_tokens(colocated.open, ids) == 0
    assert cached_tokens(colocated.open, ids) == 36  # all but the last, as SGLang; whole pages of 16 said 32
    # A prompt that leaves the second cached page part-way shares a page and 4 tokens of the next.
    assert cached_tokens(colocated.open, ids[:20] + fresh_prompt(60, 17)) == 20


def test_any_model_name_is_served_without_served_model_name(colocated):
    c = client(colocated.open)
    chat = c.chat.completions.create(model="gpt-9", messages=USER, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.model == "gpt-9"
    assert c.completions.create(model="anything", prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    assert post(colocated.open, "/v1/tokenize", {"model": "x", "prompt": "hi"}).status_code == 200


def test_with_served_model_name_another_name_is_a_400(named):
    c = client(named)
    with pytest.raises(openai.BadRequestError) as chat:
        c.chat.completions.create(model="wrong_model_name", messages=USER, max_tokens=2)
    assert "The model `wrong_model_name` does not exist" in str(chat.value)
    assert f"The served model name is `{NAME}`" in str(chat.value) and chat.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as completion:
        c.completions.create(model="wrong_model_name", prompt="hi", max_tokens=2)
    assert "The model `wrong_model_name` does not exist" in str(completion.value)
    for name in (NAME, "default"):
        assert c.chat.completions.create(model=name, messages=USER, max_tokens=2).usage.completion_tokens <= 2
    # "base:adapter" names an adapter of the served model: refused for LoRA, not as an unknown model
    with pytest.raises(openai.BadRequestError) as adapter:
        c.chat.completions.create(model=f"{NAME}:some_adapter", messages=USER, max_tokens=2)
    assert "does not exist" not in str(adapter.value) and "LoRA is not enabled" in str(adapter.value)
    with pytest.raises(openai.BadRequestError) as responses:
        c.responses.create(model="wrong_model_name", input="hi", max_output_tokens=2)
    assert responses.value.body["param"] == "model"


def test_a_length_the_context_cannot_hold_is_a_400_in_sglangs_words(colocated):
    c, limit = client(colocated.open), context_length(colocated.open)
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="default", messages=USER, **{field: limit + 1})
        assert f"max_completion_tokens is too large: {limit + 1}" in str(err.value), err.value
    with pytest.raises(openai.BadRequestError) as err:  # fits the context, not beside the prompt
        c.chat.completions.create(model="default", messages=USER, max_tokens=limit - 3)
    assert f"Requested token count exceeds the model's maximum context length of {limit} tokens" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="default", prompt="Hello", max_tokens=limit + 1)
    assert "max_tokens is too large" in str(err.value)
    r = post(colocated.open, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": limit + 1}})
    assert r.status_code == 400 and r.json()["param"] == "sampling_params.max_new_tokens", r.text
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="default", messages=[{"role": "user", "content": "hello " * limit}])
    assert "is longer than the model's context length" in str(err.value)
    # /v1/responses caps max_output_tokens at what the context leaves, as SGLang does
    capped = c.responses.create(model="default", input="What is the capital of France?", temperature=0,
                                max_output_tokens=limit + 1)
    assert "Paris" in capped.output_text


def test_responses_errors_come_in_openais_envelope(colocated):
    url = colocated.open.base + "/responses"
    bad = requests.post(url, json={"model": "default", "input": "hi", "tool_choice": "sometimes"}, timeout=30)
    assert bad.status_code == 400 and bad.json().keys() == {"error"}, bad.text
    assert bad.json()["error"].keys() == {"message", "type", "param", "code"}
    assert bad.json()["error"]["param"] == "tool_choice" and bad.json()["error"]["code"] == 400
    unknown = "resp_" + "0" * 32
    chained = requests.post(url, json={"model": "default", "input": "hi", "previous_response_id": unknown},
                            timeout=30)
    assert chained.status_code == 400 and chained.json()["error"]["param"] == "previous_response_id", chained.text
    missing = requests.get(f"{url}/{unknown}", timeout=30)
    assert missing.status_code == 404 and "not found" in missing.json()["error"]["message"], missing.text


def test_score_refusals_carry_sglangs_error_type(colocated):
    r = post(colocated.open, "/v1/score", {"query": "The capital of France is", "items": [" Paris"],
                                           "label_token_ids": [999999]})
    assert r.status_code == 400 and r.json()["type"] == "BadRequestError", r.text
    assert r.json()["param"] == "label_token_ids"
    assert r.json()["message"] == "Token ID 999999 is out of vocabulary (vocab size: 49152)"


@pytest.mark.parametrize("extra, words", [
    ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "Tools cannot be empty if tool choice is set to a specific tool."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Tool 'nope' not found in tools list."),
])
def test_tool_choice_refusals_in_sglangs_words(colocated, extra, words):
    with pytest.raises(openai.BadRequestError) as err:
        client(colocated.open).chat.completions.create(model="default", messages=USER, max_tokens=2, **extra)
    assert err.value.body["message"] == words and err.value.body["param"] == "tool_choice"
