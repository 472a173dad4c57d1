"""The status page (`/`, `/status`) and its data (`/status.json`) on a real gateway and worker, the page
rendered in headless Chromium as a user's browser would (the screenshot is kept in pytest's tmp dir)."""
from __future__ import annotations

import shutil
import subprocess
import time

from types import SimpleNamespace

import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.services.gateway.apis import jobs_proxy
from pdserve.services.gateway.apis.context import GATEWAY
from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.apis.status_page import Snapshot, batches_in_flight, describe_worker, median_between

TIMEOUT = 60
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=5000")


def generate(gw, tokens: int = 8) -> None:
    r = requests.post(gw.url + "/generate", headers=gw.headers(), timeout=TIMEOUT, json={
        "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": tokens,
                                                                "ignore_eos": True}})
    assert r.status_code == 200, r.text


def status_with_throughput(gw, timeout: float = 12.0) -> dict:
    """/status.json once a sample has counted the tokens just generated (one sample every few seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        r = requests.get(gw.url + "/status.json", headers=gw.headers(), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        body = r.json()
        counted = any(p["tokens_per_s"] > 0 for p in body["samples"]["points"])
        # the pool refreshes each worker's load every half second: wait until it has seen the worker idle too
        idle = all(w["running"] == 0 and w["queued"] == 0 for ws in body["workers"].values() for w in ws)
        if (counted and idle) or time.monotonic() > deadline:
            return body
        time.sleep(0.5)


def chromium(*args: str, cwd) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed: run scripts/setup (it installs it with apt-get)"
    done = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={cwd}/profile", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_status_json_shows_workers_requests_and_recent_throughput(colocated):
    gw = colocated.open
    generate(gw)
    generate(gw)
    body = status_with_throughput(gw)
    assert body["mode"] == "colocated"
    [worker] = body["workers"]["colocated"]
    assert set(body["workers"]) == {"colocated"}
    assert worker["address"] == colocated.worker and worker["role"] == "colocated" and worker["healthy"] is True
    assert worker["running"] == 0 and worker["queued"] == 0 and worker["in_flight"] == 0
    assert worker["kv"]["total_pages"] > 0 and 0 <= worker["kv"]["fraction"] <= 1
    assert worker["kv"]["storage"] is None and worker["kv"]["host"] is None  # no tier below the pool here
    assert body["requests"] == {"running": 0, "queued": 0}
    assert "batches_in_flight" not in body  # no --jobs-url
    active = [p for p in body["samples"]["points"] if p["tokens_per_s"] > 0]
    assert active, body["samples"]
    assert any(p["ttft_p50_s"] is not None and p["ttft_p50_s"] > 0 for p in active)
    assert all(abs(p["t"] - time.time()) < 700 for p in body["samples"]["points"])


def test_page_is_open_but_its_data_needs_the_key(colocated):
    gw = colocated.secured
    for path in ("/", "/status"):
        r = requests.get(gw.url + path, timeout=TIMEOUT)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html")
        assert "status.json" in r.text and "sessionStorage" in r.text
        assert "http://" not in r.text and "https://" not in r.text  # nothing fetched from elsewhere
    assert requests.get(gw.url + "/status.json", timeout=TIMEOUT).status_code == 401
    assert requests.get(gw.url + "/status.json", headers=gw.headers(), timeout=TIMEOUT).status_code == 200


def test_other_clients_requests_are_the_admin_keys_where_both_keys_are_set(colocated):
    # colocated.secured has an API key and an admin key: the API key is every client's, so it does not see the
    # requests' ids, timings and token counts (/status.json's timelines, /debug/requests); the admin key does.
    gw = colocated.secured
    r = requests.post(gw.url + "/generate", headers=gw.headers(), timeout=TIMEOUT,
                      json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}})
    rid = r.headers["X-Request-Id"]
    as_client = requests.get(gw.url + "/status.json", headers=gw.headers(), timeout=TIMEOUT).json()
    assert as_client["timelines"] is None and as_client["workers"] and rid not in str(as_client)
    as_admin = requests.get(gw.url + "/status.json", headers=gw.admin_headers(), timeout=TIMEOUT).json()
    assert rid in str(as_admin["timelines"]["recent"])
    r = requests.get(f"{gw.url}/debug/requests/{rid}", headers=gw.headers(), timeout=TIMEOUT)
    assert r.status_code == 401 and "admin key" in r.json()["message"] and rid not in r.text
    r = requests.get(f"{gw.url}/debug/requests/{rid}", headers=gw.admin_headers(), timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["timelines"][0]["prompt_tokens"] > 0, r.text
    # Without an API key there is no client to tell apart: the timelines are everyone's, as before.
    assert requests.get(colocated.open.url + "/status.json", timeout=TIMEOUT).json()["timelines"] is not None


def test_page_renders_workers_and_chart_in_chromium(colocated, tmp_path):
    gw = colocated.open
    generate(gw)
    status_with_throughput(gw)
    dom = chromium("--dump-dom", gw.url + "/status", cwd=tmp_path)
    assert colocated.worker in dom
    assert "<td>colocated</td>" in dom and '<span class="healthy">healthy</span>' in dom
    assert 'id="chart-throughput"' in dom and "<polyline" in dom
    assert "Output tokens/s" in dom and "TTFT p50 (ms)" in dom

    shot = tmp_path / "status.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,900", gw.url + "/", cwd=tmp_path)
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, len(data)


def test_page_asks_for_the_key_in_chromium(colocated, tmp_path):
    dom = chromium("--dump-dom", colocated.secured.url + "/", cwd=tmp_path)
    assert 'id="keyform" style="display: block;"' in dom
    assert colocated.worker not in dom


def test_a_worker_with_tiers_shows_their_occupancy():
    def worker(**load) -> SimpleNamespace:
        return SimpleNamespace(address="w:1", role="prefill", healthy=True, last_error="", in_flight=0,
                               moved_out=0, moved_in=0, load=pb.LoadReply(total_pages=100, free_pages=40, **load))

    tiered = describe_worker(worker(storage_tier=True, storage_pages=1200, storage_bytes=1200 * 36928))
    assert tiered["kv"]["storage"] == {"pages": 1200, "bytes": 1200 * 36928}
    assert tiered["kv"]["used_pages"] == 60
    assert describe_worker(worker())["kv"]["storage"] is None
    hosted = describe_worker(worker(host_tier=True, host_pages=150, host_capacity=200))
    assert hosted["kv"]["host"] == {"pages": 150, "total_pages": 200} and hosted["kv"]["storage"] is None
    assert describe_worker(worker())["kv"]["host"] is None


def test_ttft_median_is_interpolated_within_the_interval():
    before = Snapshot(0.0, 0.0, ((0.1, 5.0), (0.2, 5.0), (float("inf"), 5.0)))
    after = Snapshot(3.0, 30.0, ((0.1, 6.0), (0.2, 9.0), (float("inf"), 9.0)))  # 1 in (0, 0.1], 3 in (0.1, 0.2]
    assert median_between(before, after) == pytest.approx(0.1 + 0.1 * (1 / 3))
    assert median_between(after, after) is None


async def test_batches_in_flight_are_counted_from_the_jobs_service():
    async def list_batches(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer k" and request.query["limit"] == "100"
        return web.json_response({"data": [{"status": s} for s in ("in_progress", "validating", "completed",
                                                                   "failed", "finalizing")]})

    jobs = web.Application()
    jobs.router.add_get("/v1/batches", list_batches)
    upstream = TestServer(jobs)
    await upstream.start_server()

    async def batches(request: web.Request) -> web.Response:
        return web.json_response(await batches_in_flight(request))

    app = web.Application()
    app[GATEWAY] = SimpleNamespace(jobs_url=str(upstream.make_url("")))
    app.cleanup_ctx.append(jobs_proxy.open_session)
    app.router.add_get("/b", batches)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        r = await client.get("/b", headers={"Authorization": "Bearer k"})
        assert await r.json() == {"count": 3}
        await upstream.close()
        r = await client.get("/b", headers={"Authorization": "Bearer k"})
        assert "unreachable" in (await r.json())["error"]
    finally:
        await client.close()
        await upstream.close()
