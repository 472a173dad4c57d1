"""Multi-LoRA through the gateway, with prefill and decode as real processes (and a colocated worker beside):
adapters named by `model` or `lora_path`, mixed in one batch, loaded and unloaded while serving, each answer
equal to transformers+PEFT's greedy one (fp32), and every bad adapter refused with a 400 that names it."""
from __future__ import annotations

import json
import shutil

import pytest
import requests
import torch

from harness import API_KEY, start_gateway
from procs import start_worker

NEW_TOKENS = 10
QUESTION = "What is the capital of France?"
STARTUP = ("sql", "poet")  # loaded at start-up; "terse" is loaded while serving


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def peft_tokens(default_model_dir, default_model_adapters, prompt_ids) -> dict:
    """{adapter or None: transformers+PEFT greedy tokens of the prompt}."""
    from lora_adapters import _load_base, load_peft_model

    out = {}
    for name in (None, "sql", "poet", "terse"):
        model = (_load_base(default_model_dir) if name is None
                 else load_peft_model(default_model_dir, default_model_adapters[name]))
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=2)
        out[name] = gen[0, len(prompt_ids):].tolist()
    return out


@pytest.fixture(scope="module")
def system(default_model_dir, default_model_adapters):
    lora = ["--lora-paths", *(f"{n}={default_model_adapters[n]}" for n in STARTUP), "--max-lora-rank", "16",
            "--lora-target-modules", "all", "--max-loras-per-batch", "2"]
    common = ("--dtype", "float32", "--transfer-backend", "tcp", *lora)
    prefill, paddr = start_worker("prefill", None, *common)
    prefill.wait_healthy()
    decode, daddr = start_worker("decode", None, *common, "--prefill", paddr)
    colocated, caddr = start_worker("colocated", None, "--dtype", "float32", *lora)
    decode.wait_healthy()
    colocated.wait_healthy()
    pd = start_gateway(default_model_dir, "--prefill", paddr, "--decode", daddr, "--api-key", API_KEY)
    co = start_gateway(default_model_dir, "--worker", caddr)
    pd.proc.wait_healthy()
    co.proc.wait_healthy()
    yield {"pd": pd, "colocated": co}
    for proc in (pd.proc, co.proc, decode, prefill, colocated):
        proc.stop()


def post(gw, path: str, body: dict) -> requests.Response:
    return requests.post(gw.url + path, json=body, headers=gw.admin_headers(), timeout=300)


def generate_ids(gw, ids: list[int], lora_path=None, model=None, count: int = 1) -> list[list[int]]:
    body = {"input_ids": [ids] * count if count > 1 else ids, "lora_path": lora_path, "model": model,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}}
    r = post(gw, "/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    return [o["output_ids"] for o in (out if isinstance(out, list) else [out])]


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_one_batch_of_adapters_and_base_matches_peft(system, prompt_ids, peft_tokens, mode):
    """A batch of four prompts for two adapters and the base model (two LoRA slots) gets PEFT's tokens."""
    names = [None, "sql", "poet", "sql"]
    got = generate_ids(system[mode], prompt_ids, lora_path=names, count=len(names))
    assert got == [peft_tokens[n] for n in names]


def test_openai_client_names_adapters_by_model_and_lora_path(system, default_model_dir, peft_tokens):
    from openai import OpenAI
    from transformers import AutoTokenizer

    gw = system["pd"]
    client = OpenAI(base_url=gw.base, api_key=API_KEY)
    base = client.models.list().data[0].id
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": QUESTION}]
    for kwargs, adapter in ((dict(model=f"{base}:sql"), "sql"), (dict(model="poet"), "poet"),
                            (dict(model=base, extra_body={"lora_path": "sql"}), "sql"), (dict(model=base), None)):
        out = client.chat.completions.create(messages=messages, temperature=0, max_tokens=NEW_TOKENS,
                                             extra_body={"min_tokens": NEW_TOKENS, **kwargs.pop("extra_body", {})},
                                             **kwargs)
        assert out.choices[0].message.content == tok.decode(peft_tokens[adapter], skip_special_tokens=True), adapter


def test_models_lists_the_adapters_with_their_parent(system, default_model_adapters):
    gw = system["pd"]
    cards = requests.get(gw.base + "/models", headers=gw.headers(), timeout=10).json()["data"]
    base = cards[0]["id"]
    adapters = {c["id"]: c for c in cards[1:]}
    assert set(adapters) == set(STARTUP)
    assert all(c["parent"] == base for c in adapters.values())
    assert adapters["sql"]["root"] == str(default_model_adapters["sql"])
    one = requests.get(gw.base + "/models/poet", headers=gw.headers(), timeout=10).json()
    assert one["parent"] == base


def test_unknown_adapters_are_refused_by_name(system, prompt_ids):
    gw = system["pd"]
    r = post(gw, "/generate", {"input_ids": prompt_ids, "lora_path": "nope"})
    assert r.status_code == 400
    assert r.json()["param"] == "lora_path" and "'nope' is not loaded" in r.json()["message"]
    base = requests.get(gw.base + "/models", headers=gw.headers(), timeout=10).json()["data"][0]["id"]
    r = post(gw, "/v1/chat/completions", {"model": f"{base}:nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["param"] == "model" and "'nope'" in r.json()["message"]
    # A name that is no adapter (nor the model) is served by the base model, as SGLang without --served-model-name
    r = post(gw, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 1})
    assert r.status_code == 200, r.text
    # A server path that was never loaded is refused too: a request never makes a worker read a file.
    r = post(gw, "/generate", {"input_ids": prompt_ids, "lora_path": "/etc"})
    assert r.status_code == 400 and "'/etc' is not loaded" in r.json()["message"]


def test_load_use_and_unload_while_serving(system, default_model_adapters, prompt_ids, peft_tokens):
    gw = system["pd"]
    r = post(gw, "/load_lora_adapter", {"lora_name": "terse", "lora_path": str(default_model_adapters["terse"])})
    assert r.status_code == 200, r.text
    assert r.json()["success"] and set(r.json()["loaded_adapters"]) == {"sql", "poet", "terse"}
    assert generate_ids(gw, prompt_ids, lora_path="terse") == [peft_tokens["terse"]]
    # By the directory it was loaded from, too.
    assert generate_ids(gw, prompt_ids, lora_path=str(default_model_adapters["terse"])) == [peft_tokens["terse"]]
    r = post(gw, "/unload_lora_adapter", {"lora_name": "terse"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"sql", "poet"}
    r = post(gw, "/generate", {"input_ids": prompt_ids, "lora_path": "terse"})
    assert r.status_code == 400
    r = post(gw, "/unload_lora_adapter", {"lora_name": "terse"})
    assert r.status_code == 400 and "'terse' is not loaded" in r.json()["message"]


def test_bad_adapters_are_refused_and_nothing_is_loaded(system, default_model_adapters, tmp_path):
    gw = system["pd"]
    corrupt = tmp_path / "corrupt"
    shutil.copytree(default_model_adapters["terse"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    big = tmp_path / "big"
    shutil.copytree(default_model_adapters["terse"], big)
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    for name, path, problem in (("corrupt", corrupt, "adapter 'corrupt'"),
                                ("big", big, "rank 64 exceeds --max-lora-rank 16"),
                                ("missing", tmp_path / "missing", "adapter 'missing'")):
        r = post(gw, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, r.text
        assert problem in r.json()["message"] and r.json()["success"] is False
    cards = requests.get(gw.base + "/models", headers=gw.headers(), timeout=10).json()["data"]
    assert {c["id"] for c in cards[1:]} == set(STARTUP)
    r = post(gw, "/load_lora_adapter", {"lora_name": "../x", "lora_path": str(big)})
    assert r.status_code == 400 and r.json()["param"] == "lora_name"


def test_adapter_requests_need_lora_on_the_server(colocated):
    """A server started without LoRA answers adapter requests with a 400 that says how to enable it."""
    gw = colocated.open
    r = post(gw, "/generate", {"text": "hi", "lora_path": "sql"})
    assert r.status_code == 400 and "LoRA is not enabled" in r.json()["message"]
    r = post(gw, "/load_lora_adapter", {"lora_name": "sql", "lora_path": "/tmp"})
    assert r.status_code == 400 and "--enable-lora" in r.json()["message"]


def test_prefill_and_decode_with_other_adapters_are_refused_at_registration(default_model_adapters):
    sql, poet = (f"{n}={default_model_adapters[n]}" for n in ("sql", "poet"))
    prefill, paddr = start_worker("prefill", None, "--transfer-backend", "tcp", "--lora-paths", sql)
    prefill.wait_healthy()
    try:
        decode, _ = start_worker("decode", None, "--transfer-backend", "tcp", "--lora-paths", poet, "--prefill", paddr)
        decode.popen.wait(120)
        assert decode.popen.returncode != 0
        assert "lora_adapters: prefill has [sql@" in decode.tail() and "decode has [poet@" in decode.tail()
    finally:
        prefill.stop()


def test_a_lora_path_error_says_nothing_about_what_is_on_the_host(system, tmp_path):
    """Missing, a plain file, an empty folder, a folder with a pickle: one answer, whatever is there."""
    gw = system["pd"]
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "adapter_config.json").write_text("{}")
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"pickle")
    for what in ("missing", "file", "empty", "pickle"):
        path = str(tmp_path / what)
        r = post(gw, "/load_lora_adapter", {"lora_name": "probe", "lora_path": path})
        assert r.status_code == 400 and r.json()["success"] is False
        assert r.json()["message"].replace(path, "PATH") == (
            "adapter 'probe': no PEFT LoRA adapter to load at 'PATH' (a directory this worker can read, holding "
            "adapter_config.json and adapter_model.safetensors)"), r.json()["message"]
