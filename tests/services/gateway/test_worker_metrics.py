"""/metrics scraped from real processes, as Prometheus and llm-d's endpoint picker scrape it.

Workers: SGLang's names and types labelled with the served model's `model_name`; token counters that grow by
exactly what the requests used; a KV-use gauge in [0, 1] that counts the idle prefix cache as free; latency
histograms that counted the requests; in a PD pair, the split of these between prefill and decode, KV-transfer
bytes by decode peer, and the LoRA info metric of workers started with --enable-lora. Gateway: /metrics needs
no API key. The Grafana dashboard queries only metrics that the services export.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from harness import API_KEY, Gateway, System, start_gateway, start_worker, wait_idle, worker_call

DASHBOARD = Path(__file__).resolve().parents[3] / "dashboards" / "pdserve-grafana.json"
TYPES = {
    "gauge": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
              "sglang:num_used_tokens", "sglang:max_total_num_tokens", "sglang:cache_config_info"),
    "counter": ("sglang:prompt_tokens", "sglang:cached_tokens", "sglang:generation_tokens", "sglang:num_requests",
                "sglang:num_aborted_requests"),
    "histogram": ("sglang:queue_time_seconds", "sglang:time_to_first_token_seconds",
                  "sglang:inter_token_latency_seconds", "sglang:e2e_request_latency_seconds"),
}
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
# Several whole KV pages long, so that running it again is served from the prefix cache.
PROMPT = "Tell me about the history of Paris, the capital of France, from the Romans to the present day. " * 3
NEW_TOKENS = 6


class Scrape:
    """One scrape of a /metrics page, parsed."""

    def __init__(self, url: str, headers: dict | None = None) -> None:
        r = requests.get(url, headers=headers or {}, timeout=30)
        assert r.status_code == 200, r.text
        self.families = {f.name: f for f in text_string_to_metric_families(r.text)}

    def samples(self, name: str) -> list:
        return [s for f in self.families.values() for s in f.samples if s.name == name]

    def value(self, name: str) -> float:
        """The sample's value, summed over its label sets (0 when it has none yet)."""
        return sum(s.value for s in self.samples(name))

    def exported_names(self) -> set[str]:
        """Every sample name the families declare, with or without samples yet (e.g. per-peer counters)."""
        return {f.name + suffix for f in self.families.values() for suffix in SAMPLE_SUFFIXES.get(f.type, ("",))}


def metrics_url(proc) -> str:
    return proc.health_url.replace("/health", "/metrics")


def generate(gw: Gateway) -> dict:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0}}
    r = requests.post(gw.url + "/generate", json=body, headers=gw.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def check_names_and_types(scrape: Scrape, model_name: str) -> None:
    for kind, names in TYPES.items():
        for name in names:
            assert scrape.families[name].type == kind, name
    for family in scrape.families.values():
        if family.name.startswith("sglang:") and family.samples:
            assert {s.labels.get("model_name") for s in family.samples} == {model_name}, family.name
    assert 0 <= scrape.value("sglang:token_usage") <= 1


# ---------------------------------------------------------------- colocated (the shared gateway-test system)
def test_colocated_worker_exports_sglang_metrics(colocated):
    worker = colocated.system.workers[colocated.worker]
    model_name = worker_call(colocated.worker, "Info").served_model_name
    before = Scrape(metrics_url(worker))
    metas = [generate(colocated.open) for _ in range(3)]  # one after another: the later ones hit the cache
    wait_idle(colocated.worker)
    after = Scrape(metrics_url(worker))
    check_names_and_types(after, model_name)

    def grew(name: str) -> float:
        return after.value(name) - before.value(name)

    generated = sum(m["completion_tokens"] for m in metas)
    assert generated == 3 * NEW_TOKENS
    assert grew("sglang:prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert grew("sglang:cached_tokens_total") == sum(m["cached_tokens"] for m in metas) > 0
    assert grew("sglang:generation_tokens_total") == generated
    assert grew("sglang:num_requests_total") == 3
    for name in ("queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"sglang:{name}_count") == 3, name
    assert grew("sglang:inter_token_latency_seconds_count") == generated - 3  # every token but each first
    assert after.value("sglang:cache_hit_rate") > 0
    # Idle, the prompts' pages stay in the prefix cache, yet the KV cache reads as free: they are evictable.
    assert after.value("pdserve_worker_cached_pages") > 0
    assert after.value("sglang:token_usage") == 0 and after.value("sglang:num_running_reqs") == 0
    assert "sglang:lora_requests_info" not in after.families  # no --enable-lora


def test_gateway_metrics_need_no_api_key(colocated):
    secured = colocated.secured
    scrape = Scrape(secured.url + "/metrics")
    assert scrape.families["pdserve_gateway_requests"].type == "counter"
    assert requests.get(secured.url + "/v1/models", timeout=30).status_code == 401  # the API stays guarded


# ---------------------------------------------------------------- a PD pair with LoRA enabled
@dataclass
class PD:
    system: System
    gateway: Gateway
    prefill: str  # gRPC addresses
    decode: str

    def scrape(self, addr: str) -> Scrape:
        return Scrape(metrics_url(self.system.workers[addr]))


@pytest.fixture(scope="module")
def pd(default_model_dir):
    common = ("--transfer-backend", "tcp", "--enable-lora", "--max-loras-per-batch", "2")
    system = System()
    try:
        prefill, paddr = start_worker("prefill", str(default_model_dir), *common)
        # The same prompt twice: both through the prefill worker (the decode worker would compute the second
        # itself from its cache, test_pd.py), so that the split of the metrics shows.
        decode, daddr = start_worker("decode", str(default_model_dir), *common, "--prefill", paddr,
                                     "--local-prefill-max-tokens", "0")
        system.workers.update({paddr: prefill, daddr: decode})
        gw = start_gateway(default_model_dir, "--prefill", paddr, "--decode", daddr, "--api-key", API_KEY)
        system.gateways.append(gw)
        for proc in (prefill, decode, gw.proc):
            proc.wait_healthy(180)
        yield PD(system, gw, paddr, daddr)
    finally:
        system.stop()


def test_pd_pair_splits_request_metrics_and_reports_kv_transfer(pd):
    before = {addr: pd.scrape(addr) for addr in (pd.prefill, pd.decode)}
    metas = [generate(pd.gateway) for _ in range(2)]
    for addr in (pd.decode, pd.prefill):
        wait_idle(addr)
    after = {addr: pd.scrape(addr) for addr in (pd.prefill, pd.decode)}
    for addr, scrape in after.items():
        check_names_and_types(scrape, worker_call(addr, "Info").served_model_name)

    def grew(addr: str, name: str) -> float:
        return after[addr].value(name) - before[addr].value(name)

    # Prefill: the prompts, their queue time and the KV transfer. Decode: the tokens it sent and their latency.
    assert grew(pd.prefill, "sglang:prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert grew(pd.decode, "sglang:generation_tokens_total") == sum(m["completion_tokens"] for m in metas)
    assert grew(pd.prefill, "sglang:queue_time_seconds_count") == 2
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert (grew(pd.decode, f"sglang:{name}"), grew(pd.prefill, f"sglang:{name}")) == (2, 0), name
    for name in ("sglang:prompt_tokens_total", "sglang:queue_time_seconds_count"):
        assert grew(pd.decode, name) == 0, name
    assert grew(pd.prefill, "sglang:generation_tokens_total") == 0
    assert grew(pd.prefill, "sglang:num_requests_total") == grew(pd.decode, "sglang:num_requests_total") == 2

    transfers = after[pd.prefill].samples("pdserve_worker_kv_transfer_bytes_total")
    assert [s.labels["peer"].split("-")[0] for s in transfers] == ["decode"]  # one series, the decode worker's
    assert grew(pd.prefill, "pdserve_worker_kv_transfer_bytes_total") > 0
    assert grew(pd.prefill, "pdserve_worker_kv_transfer_seconds_count") == 2
    assert after[pd.prefill].value("pdserve_worker_kv_transfer_failures_total") == 0


def test_lora_info_metric_for_the_endpoint_picker(pd):
    for addr in (pd.prefill, pd.decode):
        scrape = pd.scrape(addr)
        assert scrape.families["sglang:lora_requests_info"].type == "gauge"
        [sample] = scrape.samples("sglang:lora_requests_info")  # one series: the picker reads the newest
        assert sample.labels["max_lora"] == "2"
        assert (sample.labels["running_lora_adapters"], sample.labels["waiting_lora_adapters"]) == ("", "")
        assert abs(sample.value - time.time()) < 60  # its value is when it was updated


def test_grafana_dashboard_queries_exported_metrics(pd):
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    queries = [t["expr"] for p in panels for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {name for q in queries for name in re.findall(r"(?:sglang:|pdserve_)[A-Za-z0-9_:]+", q)}
    exported = pd.scrape(pd.prefill).exported_names() | pd.scrape(pd.decode).exported_names()
    exported |= Scrape(pd.gateway.url + "/metrics").exported_names()  # the gateway has an API key: none needed
    assert used and not used - exported, sorted(used - exported)
    assert all(p["datasource"]["uid"] == "${datasource}" and p["title"] for p in panels)
