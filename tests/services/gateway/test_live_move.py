"""Live moves on a real PD stack (a prefill worker, two decode workers in deterministic mode, a gateway): a decode
worker's running streams move to the other with their KV, the client's text is that of an undisturbed run, nothing
is computed again, and both pools end where they started."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
import requests

from harness import System, start_gateway, wait_idle
from procs import start_worker

NEW_TOKENS = 1500
# Each kind of stream a move must carry exactly (the sampler's state travels with the generation).
KINDS = {"greedy": {"temperature": 0},
         "penalties": {"temperature": 0, "frequency_penalty": 0.4, "presence_penalty": 0.3},
         "seeded": {"temperature": 0.9, "seed": 11},
         "logprobs": {"temperature": 0, "logprobs": 2}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fixtures import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("live-move") / "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def stack(model_dir):
    """(system, gateway, prefill address, [decode addresses], {address: proc})"""
    system = System()
    common = ("--transfer-backend", "tcp", "--enable-deterministic-inference")
    try:
        prefill, paddr = start_worker("prefill", str(model_dir), *common)
        decodes = [start_worker("decode", str(model_dir), *common, "--prefill", paddr, "--drain-timeout", "8")
                   for _ in range(2)]
        system.workers.update({paddr: prefill, **{a: p for p, a in decodes}})
        gw = start_gateway(model_dir, "--prefill", paddr, *[f for _, a in decodes for f in ("--decode", a)])
        system.gateways.append(gw)
        for proc in system.workers.values():
            proc.wait_healthy(180)
        gw.proc.wait_healthy(60)
        deadline = time.monotonic() + 60
        while not all(w["healthy"] for w in server_info(gw)["workers"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield system, gw, paddr
    finally:
        system.stop()


def server_info(gw) -> dict:
    return requests.get(gw.url + "/get_server_info", timeout=30).json()


def gateway_metric(gw, name: str) -> dict[str, float]:
    lines = requests.get(gw.url + "/metrics", timeout=30).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)}


def pool_clean(addr: str) -> bool:
    """Every page of the worker's pool is free or cached again (none held for a request), and its books agree."""
    _, stats = wait_idle(addr)
    return stats.used_pages == 0 and stats.free_pages + stats.cached_pages == stats.total_pages and stats.integrity_ok


async def run_streams(gw, prompts: dict[str, str], on_token=None) -> dict[str, tuple[str, float]]:
    """{kind: (text, longest wait between two chunks)} of one stream per kind."""
    client = openai.AsyncOpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=300)

    async def one(kind: str) -> tuple[str, float]:
        params = dict(KINDS[kind])
        logprobs = params.pop("logprobs", None)
        extra = {"ignore_eos": True, **{k: params.pop(k) for k in ("seed",) if k in params}}
        stream = await client.completions.create(model="default", prompt=prompts[kind], max_tokens=NEW_TOKENS,
                                                 stream=True, logprobs=logprobs, extra_body=extra, **params)
        text, last, gap, count = "", None, 0.0, 0
        async for chunk in stream:
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last = now
            text += chunk.choices[0].text if chunk.choices else ""
            count += 1
            if on_token is not None:
                on_token(kind, count)
        return text, gap
    results = await asyncio.gather(*(one(k) for k in prompts))
    return dict(zip(prompts, results))


async def test_sigterm_moves_running_streams_live(stack):
    system, gw, paddr = stack
    decodes = [a for a in system.workers if a != paddr]
    prompts = {kind: f"Stream {i} of the live move test, {kind}:" for i, kind in enumerate(KINDS)}
    reference = await run_streams(gw, prompts)
    assert all(len(text) > 0 for text, _ in reference.values())
    assert all(pool_clean(a) for a in decodes)

    counts = {k: 0 for k in KINDS}
    ready = asyncio.Event()

    def on_token(kind: str, count: int) -> None:
        counts[kind] = count
        if min(counts.values()) >= 40:
            ready.set()
    streams = asyncio.create_task(run_streams(gw, prompts, on_token))
    await asyncio.wait_for(ready.wait(), 120)
    on = {w["address"]: w["in_flight"] for w in server_info(gw)["workers"] if w["address"] in decodes}
    victim = max(decodes, key=lambda a: on[a])
    survivor = next(a for a in decodes if a != victim)
    proc = system.workers[victim]
    os.kill(proc.popen.pid, signal.SIGTERM)  # the front alone, as an orchestrator does
    signalled = time.monotonic()
    await asyncio.to_thread(proc.popen.wait, 30)  # the streams are read meanwhile
    exit_s = time.monotonic() - signalled
    moved = await asyncio.wait_for(streams, 300)

    for kind in KINDS:
        assert moved[kind][0] == reference[kind][0], kind  # no token repeated, missing or changed
    assert exit_s < 8, f"the drained decode worker took {exit_s:.1f} s to exit"
    assert max(gap for _, gap in moved.values()) < 2.0, moved
    live = gateway_metric(gw, "pdserve_gateway_migrations_total")
    assert sum(v for k, v in live.items() if 'kind="live"' in k and 'reason="drain"' in k) == on[victim] >= 1, live
    assert not any(v for k, v in live.items() if 'kind="recompute"' in k), live
    assert pool_clean(survivor)
    # The drained worker comes back for the next test, its pool as it started.
    proc.start()
    proc.wait_healthy(180)
