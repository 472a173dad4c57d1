"""Sampling extensions as a client written against SGLang sees them, on the shared colocated system (conftest.py):
`stop_regex` on /v1/completions, /v1/chat/completions and /generate (the output ends at the first match, which
it keeps; finish_reason "stop" and matched_stop the pattern); /generate's `token_ids_logprob` (the logprobs of
the named ids at every output and prompt position, checked against the output's own logprobs and against
transformers on the same weights); and a prompt scored with max_new_tokens 0 (one logprob per prompt token)."""
from __future__ import annotations

import json
import re

import openai
import pytest
import requests

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers.stops import REGEX_WINDOW, StopMatcher

TIMEOUT = 120
STORY = "Once upon a time"  # greedy: ", the city of Nova Haven was a thriving metropolis, with towering ..."
COUNT = "Count: 1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8, 9, 10, 11, ..."


def post(gw, path: str, body: dict) -> requests.Response:
    return requests.post(gw.url + path, json=body, headers=gw.headers(), timeout=TIMEOUT)


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base, api_key=gw.api_key or "unused", max_retries=0, timeout=TIMEOUT)


def ends_at_first_match(text: str, pattern: str) -> bool:
    m = re.search(pattern, text)
    return m is not None and m.end() == len(text)


# ---------------------------------------------------------------- stop_regex
@pytest.mark.parametrize("pattern", ["and|or", [r"\d{2}", "and|or"]])
def test_completions_stop_at_the_first_match_of_stop_regex(colocated, pattern):
    c = client(colocated.open)
    prompt = STORY if isinstance(pattern, str) else COUNT
    free = c.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=40)
    r = c.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=40,
                             extra_body={"stop_regex": pattern})
    choice = r.choices[0]
    expected = pattern if isinstance(pattern, str) else pattern[0]
    assert choice.finish_reason == "stop" and choice.matched_stop == expected
    assert ends_at_first_match(choice.text, expected), choice.text  # the match stays in the text, as in SGLang
    assert free.choices[0].text.startswith(choice.text) and free.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens < free.usage.completion_tokens  # generation stopped, not just the text


def test_streamed_chat_stops_at_stop_regex_with_the_same_text(colocated):
    c = client(colocated.open)
    messages = [{"role": "user", "content": "Write a story about a dragon and a knight."}]
    whole = c.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=60,
                                      extra_body={"stop_regex": r"\b(and|or)\b"})
    chunks = list(c.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=60,
                                            stream=True, extra_body={"stop_regex": r"\b(and|or)\b"}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    last = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason][-1]
    assert whole.choices[0].finish_reason == last.finish_reason == "stop"
    assert whole.choices[0].matched_stop == last.matched_stop == r"\b(and|or)\b"
    assert text == whole.choices[0].message.content and ends_at_first_match(text, r"\b(and|or)\b")


def test_generate_reports_the_matched_regex(colocated):
    out = post(colocated.open, "/generate", {"text": COUNT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 40, "stop_regex": r"\d{2}"}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d{2}"}
    assert ends_at_first_match(out["text"], r"\d{2}") and out["text"].count(",") >= 4


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "x", "stop_regex": "("}, "stop_regex", "not a valid regular expression"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_regex": ["a", "[b"]},
     "stop_regex.1", "not a valid regular expression"),
    ("/generate", {"text": "x", "sampling_params": {"stop_regex": ["a"] * 17}}, "sampling_params.stop_regex",
     "--max-stop-regex"),
    ("/v1/completions", {"prompt": "x", "stop_regex": "a" * 257}, "stop_regex", "--max-stop-regex-chars"),
    ("/v1/completions", {"prompt": "x", "stop_regex": ""}, "stop_regex", "non-empty"),
    ("/v1/completions", {"prompt": "x", "stop_regex": "a{99999999999}"}, "stop_regex", "repetition number"),
])
def test_bad_stop_regex_is_a_400_naming_the_field(colocated, path, body, param, words):
    r = post(colocated.open, path, {"model": "default", **body})
    assert r.status_code == 400, r.text
    assert r.json()["param"] == param
    assert words in r.text


def test_stop_regex_spans_pieces_and_searches_a_bounded_window():
    m = StopMatcher([], regexes=[r"b\d+c"])
    assert [m.push(p).text for p in ("ab1", "2")] == ["ab1", "2"]
    result = m.push("3cde")
    assert result.text == "3c" and result.matched == r"b\d+c" and m.push("more").text == ""
    # A stop string held back is searched too, and the earlier of the two ends the choice.
    m = StopMatcher(["STOP"], regexes=["x+y"])
    assert m.push("aaST").text == "aa"
    assert m.push("xy") == type(result)("STxy", "x+y")
    # An unbounded pattern reaches back REGEX_WINDOW characters, no further.
    m = StopMatcher([], regexes=["<.*>"])
    m.push("<" + "a" * REGEX_WINDOW)
    assert m.push(">").matched is None
    m = StopMatcher([], regexes=["<.*>"])
    m.push("<" + "a" * (REGEX_WINDOW - 2))
    assert m.push(">").matched == "<.*>"


def test_a_backtracking_stop_regex_ends_the_request_with_a_400():
    m = StopMatcher([], regexes=[r"(a|aa)+$"])
    with pytest.raises(ApiError) as exc:
        for _ in range(64):
            m.push("a" * 16 + "b")
    assert exc.value.status == 400 and "took more than" in exc.value.message


# ---------------------------------------------------------------- token_ids_logprob
@pytest.fixture(scope="module")
def reference(default_model_dir):
    """transformers' log_softmax on the same weights, in fp32: prompt ids -> [positions, vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def scored(gw, text: str, ids: list[int], max_new_tokens: int, **extra) -> dict:
    r = post(gw, "/generate", {"text": text, "return_logprob": True, "logprob_start_len": 0,
                               "token_ids_logprob": ids, "return_text_in_logprobs": True,
                               "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def check_token_ids_logprobs(out: dict, ids: list[int]) -> None:
    """SGLang's shapes, and each named id's logprob equal to the token's own where the token is one of them."""
    meta = out["meta_info"]
    inputs, outputs = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0] is None
    assert len(outputs) == meta["completion_tokens"] == len(out["output_ids"])
    for named, (lp, token, _) in zip(inputs[1:] + outputs, meta["input_token_logprobs"][1:]
                                     + meta["output_token_logprobs"]):
        assert [entry[1] for entry in named] == ids and all(isinstance(entry[2], str) for entry in named)
        assert all(entry[0] <= 0 for entry in named)
        if token in ids:
            assert named[ids.index(token)][0] == lp


def test_generate_token_ids_logprob_at_every_position(colocated, reference):
    prompt_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    ids = sorted(set(prompt_ids)) + [7042, 0, 49151]  # the prompt's own tokens, " Paris", and two unlikely ones
    out = scored(colocated.open, "The capital of France is", ids, 4)
    check_token_ids_logprobs(out, ids)
    assert out["meta_info"]["output_token_ids_logprobs"][0][ids.index(7042)][1] == out["output_ids"][0] == 7042
    ref = reference(prompt_ids + out["output_ids"][:-1])
    positions = out["meta_info"]["input_token_ids_logprobs"][1:] + out["meta_info"]["output_token_ids_logprobs"]
    # The worker computes in bf16: its logits carry ~2^-8 relative error, so a very unlikely token (logprob -20)
    # can be off by a few tenths where a likely one is off by hundredths.
    off = [(abs(entry[0] - ref[p, entry[1]].item()), ref[p, entry[1]].item())
           for p, named in enumerate(positions) for entry in named]
    assert all(d <= 0.1 + 0.02 * abs(r) for d, r in off), max(off)


def test_token_ids_logprob_in_a_batch_one_list_per_prompt(colocated):
    out = post(colocated.open, "/generate", {"text": ["Hello", "The sky is"], "return_logprob": True,
                                             "token_ids_logprob": [[1, 2], [3]],
                                             "sampling_params": {"temperature": 0, "max_new_tokens": 2}}).json()
    assert [[e[1] for e in pos] for pos in out[0]["meta_info"]["output_token_ids_logprobs"]] == [[1, 2]] * 2
    assert [[e[1] for e in pos] for pos in out[1]["meta_info"]["output_token_ids_logprobs"]] == [[3]] * 2
    assert "input_token_ids_logprobs" not in out[0]["meta_info"]  # no logprob_start_len: no prompt logprobs


@pytest.mark.parametrize("value, words", [
    ([[1, 2]], "token_ids_logprob must be a flat list of integers."),
    ([1, "2"], "token_ids_logprob must be a flat list of integers."),
    ([5, 49152], "token_ids_logprob contains out-of-vocabulary token id 49152; valid range is [0, 49152)."),
    ([-1], "out-of-vocabulary token id -1"),
])
def test_bad_token_ids_logprob_is_a_400_in_sglang_words(colocated, value, words):
    r = post(colocated.open, "/generate", {"text": "Hi", "return_logprob": True, "token_ids_logprob": value})
    assert r.status_code == 400 and words in r.text, r.text


# ---------------------------------------------------------------- scoring a prompt: max_new_tokens 0
def test_max_new_tokens_0_returns_every_prompt_logprob(colocated):
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = [7042, 8032]
    zero = scored(colocated.open, text, ids, 0)
    one = scored(colocated.open, text, ids, 1)
    meta = zero["meta_info"]
    assert zero["output_ids"] == [] and zero["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] == 15
    assert meta["input_token_logprobs"] == one["meta_info"]["input_token_logprobs"]
    assert meta["input_token_ids_logprobs"] == one["meta_info"]["input_token_ids_logprobs"]
    # As SGLang (its score API reads them so): the named ids at the position after the prompt, and no token.
    assert meta["output_token_logprobs"] == [] and len(meta["output_token_ids_logprobs"]) == 1
    assert meta["output_token_ids_logprobs"] == one["meta_info"]["output_token_ids_logprobs"]
    # Without logprob_start_len too: the position after the prompt only.
    labels = post(colocated.open, "/generate", {"text": text, "return_logprob": True, "token_ids_logprob": ids,
                                                "return_text_in_logprobs": True,
                                                "sampling_params": {"max_new_tokens": 0}}).json()["meta_info"]
    assert labels["output_token_ids_logprobs"] == meta["output_token_ids_logprobs"]
    assert "input_token_logprobs" not in labels and labels["completion_tokens"] == 0
    # The OpenAI way to score a text: an echoed prompt's logprobs with no completion.
    echo = client(colocated.open).completions.create(model="default", prompt=text, max_tokens=0, echo=True,
                                                     logprobs=1)
    lps = echo.choices[0].logprobs
    assert echo.choices[0].text == text and lps.token_logprobs[0] is None and len(lps.token_logprobs) == 15
    assert lps.token_logprobs[1:] == pytest.approx([lp for lp, _, _ in meta["input_token_logprobs"][1:]])
    # Without prompt logprobs it still ends at once, and streamed the same way.
    plain = post(colocated.open, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}}).json()
    assert plain["output_ids"] == [] and plain["meta_info"]["finish_reason"]["type"] == "length"
    r = requests.post(colocated.open.url + "/generate", stream=True, timeout=TIMEOUT, json={
        "text": text, "stream": True, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0}})
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(events[-1]["meta_info"]["input_token_logprobs"]) == 15


# ---------------------------------------------------------------- stop_token_ids past the vocabulary
def test_stop_token_ids_past_the_vocabulary_stop_nothing_and_the_others_still_stop(colocated):
    # SGLang serves a stop list written for a larger vocabulary (119690 is a Llama 3 id; this one has 49,152).
    body = {"text": COUNT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    free = post(colocated.open, "/generate", body).json()
    far = post(colocated.open, "/generate", {**body, "sampling_params": {
        **body["sampling_params"], "stop_token_ids": [119690, 2**31 - 1]}})
    assert far.status_code == 200, far.text
    assert far.json()["output_ids"] == free["output_ids"]
    assert far.json()["meta_info"]["finish_reason"]["type"] == "length"
    second = free["output_ids"][1]  # " 5, 6," -> the "5"
    mixed = post(colocated.open, "/generate", {**body, "sampling_params": {
        **body["sampling_params"], "stop_token_ids": [119690, second]}}).json()
    assert mixed["meta_info"]["finish_reason"] == {"type": "stop", "matched": second}
    assert mixed["output_ids"] == free["output_ids"][:2]
    bad = post(colocated.open, "/generate", {**body, "sampling_params": {
        **body["sampling_params"], "stop_token_ids": [-1]}})
    assert bad.status_code == 400 and "stop_token_ids" in bad.text, bad.text  # a negative id is still refused
