"""The admin key: routes that change the deployment for everyone (weights, adapters, cache, other clients'
requests, expert recording) refuse the inference key, and are off until an admin key is set.

Before, anyone with the key every client has could swap the weights, abort all requests, flush the cache (by
GET too) or start recording.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from harness import ADMIN_KEY, API_KEY, start_gateway, worker_call
from pdserve.services.up_flags import default_state_dir
from pdserve.services.up_plan import admin_key_path

REPO = Path(__file__).resolve().parents[2]

ADMIN_ROUTES = [("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/abort_request"),
                ("POST", "/update_weights_from_disk"), ("POST", "/load_lora_adapter"),
                ("POST", "/unload_lora_adapter"), ("POST", "/start_expert_distribution_record"),
                ("GET", "/dump_expert_distribution_record")]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def gateways(hostile, default_model_dir):
    made = {"keyed": start_gateway(default_model_dir, "--worker", hostile.worker, "--api-key", API_KEY),
            "no-admin-key": start_gateway(default_model_dir, "--worker", hostile.worker, "--api-key", API_KEY,
                                          admin_key=None),
            "opted-out": start_gateway(default_model_dir, "--worker", hostile.worker, "--api-key", API_KEY,
                                       "--open-admin-routes", admin_key=None)}
    try:
        for gw in made.values():
            gw.proc.wait_healthy(120)
        yield made
    finally:
        for gw in made.values():
            gw.proc.stop()


def cache_something(gw) -> None:
    r = requests.post(gw.url + "/generate", headers=bearer(API_KEY), timeout=120,
                      json={"text": " ".join(f"word{i}" for i in range(300)),  # several full KV pages
                            "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_the_inference_key_is_refused_on_admin_routes(gateways, method, path):
    r = requests.request(method, gateways["keyed"].url + path, headers=bearer(API_KEY), json={}, timeout=30)
    assert r.status_code == 401 and "admin route" in r.json()["message"]


def test_the_401_says_where_the_admin_key_is_and_holds_no_key(gateways, monkeypatch):
    message = requests.post(gateways["keyed"].url + "/flush_cache", headers=bearer(API_KEY),
                            timeout=30).json()["message"]
    assert ADMIN_KEY not in message and API_KEY not in message
    # Each place it names is where that way of starting pdserve keeps the key.
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert f"<state dir>/{admin_key_path(Path('.')).name}" in message
    assert str(admin_key_path(default_state_dir())).replace(str(Path.home()), "~", 1) in message
    assert "/run/pdserve-secrets/admin-api-key" in message
    assert 'PDSERVE_ADMIN_API_KEY="$$(cat /run/pdserve-secrets/admin-api-key)"' in (REPO / "compose.yaml").read_text()
    assert "<release>-pdserve-admin-api-key" in message and "adminApiKey.existingSecret" in message
    helpers = (REPO / "helm" / "pdserve" / "templates" / "_helpers.tpl").read_text()
    assert 'printf "%s-admin-api-key" (include "pdserve.fullname" .)) .Values.adminApiKey.existingSecret' in helpers


def test_a_flush_with_the_inference_key_changes_nothing_and_the_admin_key_flushes(gateways, hostile):
    gw = gateways["keyed"]
    cache_something(gw)
    cached = worker_call(hostile.worker, "Stats").cached_pages
    assert cached > 0
    assert requests.get(gw.url + "/flush_cache", headers=bearer(API_KEY), timeout=30).status_code == 401
    assert worker_call(hostile.worker, "Stats").cached_pages == cached
    r = requests.post(gw.url + "/flush_cache", headers=bearer(ADMIN_KEY), timeout=30)
    assert r.status_code == 200, r.text
    assert worker_call(hostile.worker, "Stats").cached_pages == 0


def test_the_admin_key_also_serves_the_inference_routes(gateways):
    r = requests.post(gateways["keyed"].url + "/v1/completions", headers=bearer(ADMIN_KEY), timeout=120,
                      json={"model": "default", "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def test_without_an_admin_key_admin_routes_are_off_and_say_how_to_turn_them_on(gateways):
    r = requests.post(gateways["no-admin-key"].url + "/flush_cache", headers=bearer(API_KEY), timeout=30)
    assert r.status_code == 403
    assert "PDSERVE_ADMIN_API_KEY" in r.json()["message"] and "--open-admin-routes" in r.json()["message"]


def test_opting_out_gives_the_old_behaviour_behind_the_api_key(gateways):
    gw = gateways["opted-out"]
    assert requests.post(gw.url + "/flush_cache", timeout=30).status_code == 401
    assert requests.post(gw.url + "/flush_cache", headers=bearer(API_KEY), timeout=30).status_code == 200


def test_no_key_reaches_the_server_info(gateways):
    info = requests.get(gateways["keyed"].url + "/get_server_info", headers=bearer(API_KEY), timeout=30).text
    assert ADMIN_KEY not in info and API_KEY not in info
