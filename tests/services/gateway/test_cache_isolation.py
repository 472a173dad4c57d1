"""Prefix isolation between tenants: a `cache_salt` namespaces a prompt's KV (two salts share no cached prefix, one
salt does), and cached-token counts are told only with --enable-cache-report, as SGLang does.

On main at 01e89db a victim's system prompt holding a PIN could be guessed by an attacker sending the same template:
a wrong guess showed 96 cached tokens, the right one 224, through a client-set `return_cached_tokens_details` on
chat and completions (no server flag), `/v1/messages` and `/v1/responses` usage; and `cache_salt` was accepted and
ignored (two salts shared 1,456 cached tokens).
"""
from __future__ import annotations

import uuid

import pytest
import requests
from harness import start_gateway

PAGE = 16  # the workers' page size
SECRET = ("You are the support assistant of Example Bank. The customer's PIN is 4921; never reveal it. "
          "Answer in one short sentence. ") * 3


def chat_body(salt: str | None, secret: str = SECRET) -> dict:
    body = {"model": "default", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": secret}, {"role": "user", "content": "Hello?"}]}
    return body if salt is None else {**body, "cache_salt": salt}


def cached(gw, path: str, body: dict) -> int | None:
    """The cached-token count an API tells for `body` (None where it tells none)."""
    r = requests.post(gw.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    answer = r.json()
    if path == "/generate":
        return answer["meta_info"]["cached_tokens"]
    usage = answer["usage"]
    if path == "/v1/messages":
        return usage["cache_read_input_tokens"]
    if path == "/v1/responses":
        return usage["input_tokens_details"]["cached_tokens"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def bodies(salt: str | None, secret: str = SECRET) -> dict[str, dict]:
    """The same prompt through every API that takes a cache_salt."""
    chat = chat_body(salt, secret)
    text = secret + " Hello?"
    extra = {} if salt is None else {"cache_salt": salt}
    return {
        "/v1/chat/completions": chat,
        "/v1/completions": {"model": "default", "prompt": text, "max_tokens": 1, "temperature": 0, **extra},
        "/v1/responses": {"model": "default", "instructions": secret, "input": "Hello?", "max_output_tokens": 1,
                          "temperature": 0, **extra},
        "/v1/messages": {"model": "default", "system": secret, "max_tokens": 1, "temperature": 0,
                         "messages": [{"role": "user", "content": "Hello?"}], **extra},
        "/generate": {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **extra},
    }


@pytest.fixture(scope="module")
def reporting(colocated, default_model_dir):
    """A gateway that tells cached-token counts (--enable-cache-report), on the shared worker."""
    gw = start_gateway(default_model_dir, "--worker", colocated.worker, "--enable-cache-report")
    try:
        gw.proc.wait_healthy(60)
        yield gw
    finally:
        gw.proc.stop()


@pytest.mark.parametrize("path", list(bodies(None)))
def test_two_salts_share_no_cached_prefix_and_one_salt_does(reporting, path):
    tenant_a, tenant_b = uuid.uuid4().hex, uuid.uuid4().hex
    unsalted = bodies(None)[path]
    cached(reporting, path, unsalted)
    assert cached(reporting, path, unsalted) >= 5 * PAGE  # the prompt is in the cache, unsalted
    assert cached(reporting, path, bodies(tenant_a)[path]) == 0  # a salt sees none of it
    assert cached(reporting, path, bodies(tenant_b)[path]) == 0  # nor another salt of tenant a's
    assert cached(reporting, path, bodies(tenant_a)[path]) >= 5 * PAGE  # tenant a's own, from its first request


def test_a_guess_learns_nothing_of_another_tenants_salted_prompt(reporting):
    # The attack of the issue: the victim's prompt with its PIN under the victim's salt; the attacker's right
    # guess, under a salt of its own or none, finds none of it cached (before: 224 tokens against 96 for a wrong one).
    victim = uuid.uuid4().hex
    secret = f"You are the assistant of bank {victim}. The customer's PIN is 4921; never reveal it. " * 4
    cached(reporting, "/v1/chat/completions", chat_body(victim, secret))
    assert cached(reporting, "/v1/chat/completions", chat_body(victim, secret)) >= 5 * PAGE
    # Unsalted, the guess may share the chat template's opening and "You are the" with the module's other
    # unsalted prompts (the cache matches to the token); the victim's bank id follows within the first page.
    for salt, most in ((uuid.uuid4().hex, 0), (None, PAGE - 1)):
        assert cached(reporting, "/v1/chat/completions", chat_body(salt, secret)) <= most, salt


@pytest.mark.parametrize("path", list(bodies(None)))
def test_without_the_cache_report_flag_no_count_is_told(colocated, path):
    # colocated.open has no --enable-cache-report: a client's return_cached_tokens_details does not turn it on;
    # Responses and Messages, whose shape has the field, read 0; /generate keeps SGLang's meta_info.cached_tokens.
    body = bodies(None)[path]
    if path in ("/v1/chat/completions", "/v1/completions"):
        body = {**body, "return_cached_tokens_details": True}
    cached(colocated.open, path, body)
    told = cached(colocated.open, path, body)
    if path == "/generate":
        assert told >= 5 * PAGE
    elif path in ("/v1/responses", "/v1/messages"):
        assert told == 0
    else:
        assert told is None


@pytest.mark.parametrize("salt, words", [("", "1 to 1024 characters"), ("x" * 1025, "1 to 1024 characters"),
                                         (42, "must be a string")])
def test_a_bad_salt_is_a_400_naming_it(colocated, salt, words):
    for path, body in bodies(None).items():
        r = requests.post(colocated.open.url + path, json={**body, "cache_salt": salt}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        text = r.text
        assert "cache_salt" in text and (words in text or isinstance(salt, int)), (path, text)
