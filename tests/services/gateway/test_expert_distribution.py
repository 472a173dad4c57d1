"""SGLang's expert-distribution endpoints through the gateway: a tiny MoE model on prefill and decode processes
that both record, their dumps summed into one SGLang stat file; refused with a 400 on a dense model and on
workers started without --expert-distribution-recorder-mode."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests
import torch

from harness import start_gateway
from procs import start_worker

NEW_TOKENS = 4
PROMPTS = ["What is the capital of France?", "one two three four five"]


@pytest.fixture(scope="module")
def systems(tiny_models, tmp_path_factory):
    """{"pd": gateway over prefill + decode recording into `dir`, "off": gateway over a colocated worker
    without the mode}, all on the tiny Qwen2-MoE model."""
    model = str(tiny_models["qwen2-moe"])
    out = tmp_path_factory.mktemp("expert-dumps")
    record = ("--dtype", "float32", "--expert-distribution-recorder-mode", "stat",
              "--expert-distribution-recorder-dir", str(out))
    prefill, paddr = start_worker("prefill", model, *record, "--transfer-backend", "tcp")
    colocated, caddr = start_worker("colocated", model, "--dtype", "float32")
    prefill.wait_healthy()
    decode, daddr = start_worker("decode", model, *record, "--transfer-backend", "tcp", "--prefill", paddr)
    pd = start_gateway(model, "--prefill", paddr, "--decode", daddr)
    off = start_gateway(model, "--worker", caddr)
    procs = [pd.proc, off.proc, decode, prefill, colocated]
    try:
        for proc in procs:
            proc.wait_healthy()
        yield {"pd": pd, "off": off, "dir": out}
    finally:
        for proc in procs:
            proc.stop()


def call(gw, method: str, path: str) -> requests.Response:
    return requests.request(method, gw.url + path, headers=gw.admin_headers(), timeout=60)


def dump(gw) -> tuple[Path, dict[str, Path]]:
    """(the merged file, {role: that worker's file}) a dump wrote, as its answer names them."""
    r = call(gw, "POST", "/dump_expert_distribution_record")
    assert r.status_code == 200, r.text
    assert r.text.startswith("Dump expert distribution record.\n")  # SGLang's answer, then where the files went
    merged = Path(re.search(r"^file: (.+)$", r.text, re.M).group(1))
    workers = dict(re.findall(r"^worker (\w+) \S+: \d+ selections, file (.+)$", r.text, re.M))
    return merged, {role: Path(path) for role, path in workers.items()}


def test_pd_workers_both_record_and_the_dump_sums_them(systems, tiny_models):
    from pdserve.shared.config import ModelConfig

    gw = systems["pd"]
    moe = ModelConfig.from_dir(tiny_models["qwen2-moe"]).moe
    r = call(gw, "POST", "/start_expert_distribution_record")
    assert (r.status_code, r.text) == (200, "Start recording the expert distribution.\n")
    gen = requests.post(gw.url + "/generate", json={"text": PROMPTS, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}}, timeout=60)
    assert gen.status_code == 200, gen.text
    r = call(gw, "GET", "/stop_expert_distribution_record")  # SGLang takes GET as well as POST
    assert (r.status_code, r.text) == (200, "Stop recording the expert distribution.\n")

    merged_path, paths = dump(gw)
    assert set(paths) == {"prefill", "decode"}
    # SGLang's file name, in the workers' --expert-distribution-recorder-dir, beside each worker's own file.
    assert re.fullmatch(r"expert_distribution_recorder_[\d.]+\.pt", merged_path.name)
    assert {merged_path, *paths.values()} <= set(systems["dir"].iterdir())
    merged = torch.load(merged_path)
    workers = {role: torch.load(path) for role, path in paths.items()}
    counts = merged["logical_count"]  # [1, layers, experts], SGLang's stat format
    assert counts.shape == (1, 2, moe.num_experts) and merged["rank"] == 0
    assert torch.equal(counts, workers["prefill"]["logical_count"] + workers["decode"]["logical_count"])
    # Prefill routes each prompt token it computed, decode each generated token but the last (the first comes
    # from prefill); k experts in each of the model's expert layers.
    metas = [o["meta_info"] for o in gen.json()]
    per_token = moe.top_k * len(moe.sparse_layers)
    prefilled = sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas)
    assert workers["prefill"]["logical_count"].sum() == prefilled * per_token
    assert workers["decode"]["logical_count"].sum() == sum(m["completion_tokens"] - 1 for m in metas) * per_token

    again, _ = dump(gw)  # a dump clears the counts
    assert torch.load(again)["logical_count"].sum() == 0


@pytest.mark.parametrize("which,reason", [("dense", "has no experts"), ("off", "--expert-distribution-recorder-mode")])
def test_refused_with_a_400_saying_why(systems, colocated, which, reason):
    gw = colocated.open if which == "dense" else systems["off"]  # the default model (dense); MoE without the mode
    for method, path in (("POST", "/start_expert_distribution_record"), ("GET", "/stop_expert_distribution_record"),
                         ("POST", "/dump_expert_distribution_record")):
        r = call(gw, method, path)
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["object"] == "error" and reason in body["message"], body
