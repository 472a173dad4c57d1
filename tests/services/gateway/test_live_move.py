"""Live moves on a real PD stack (a prefill worker, two decode workers in deterministic mode, a gateway): a decode
worker's running streams move to the other with their KV, the client's text is that of an undisturbed run, nothing
is computed again, and both pools end where they started. Drained (SIGTERM), moved by an operator (`pdserve debug
migrate`), and the faults: the source or the destination killed mid-move, the client gone mid-move. Every KV write
of a decode worker here waits WRITE_DELAY_S first, so that a fault lands while the pages are on their way."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import requests

from harness import ADMIN_KEY, System, start_gateway, wait_idle
from procs import start_worker

NEW_TOKENS = 1500
WRITE_DELAY_S = 0.3
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
        decodes = [start_worker("decode", str(model_dir), *common, "--prefill", paddr, "--drain-timeout", "30",
                                env={"PDSERVE_TEST_KV_WRITE_DELAY_S": str(WRITE_DELAY_S)}) for _ in range(2)]
        system.workers.update({paddr: prefill, **{a: p for p, a in decodes}})
        gw = start_gateway(model_dir, "--prefill", paddr, *[f for _, a in decodes for f in ("--decode", a)])
        system.gateways.append(gw)
        for proc in system.workers.values():
            proc.wait_healthy(180)
        gw.proc.wait_healthy(60)
        all_healthy(gw)
        yield system, gw, paddr
    finally:
        system.stop()


def all_healthy(gw) -> None:
    deadline = time.monotonic() + 60
    while not all(w["healthy"] for w in server_info(gw)["workers"]) and time.monotonic() < deadline:
        time.sleep(0.2)


def server_info(gw) -> dict:
    return requests.get(gw.url + "/get_server_info", timeout=30).json()


def gateway_metric(gw, name: str) -> dict[str, float]:
    lines = requests.get(gw.url + "/metrics", timeout=30).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)}


def pool_clean(addr: str) -> bool:
    """Every page of the worker's pool is free or cached again (none held for a request), and its books agree."""
    _, stats = wait_idle(addr)
    return stats.used_pages == 0 and stats.free_pages + stats.cached_pages == stats.total_pages and stats.integrity_ok


async def run_streams(gw, prompts: dict[str, str], on_token=None,
                      new_tokens: int = NEW_TOKENS) -> dict[str, tuple[str, float]]:
    """{kind: (text, longest wait between two chunks)} of one stream per kind."""
    client = openai.AsyncOpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=300)

    async def one(kind: str) -> tuple[str, float]:
        params = dict(KINDS[kind])
        logprobs = params.pop("logprobs", None)
        extra = {"ignore_eos": True, **{k: params.pop(k) for k in ("seed",) if k in params}}
        stream = await client.completions.create(model="default", prompt=prompts[kind], max_tokens=new_tokens,
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
    # Within seconds, not its 30 s drain: the streams are not waited out (their undisturbed run took ~10 s here).
    assert exit_s < 10, f"the drained decode worker took {exit_s:.1f} s to exit:\n{proc.tail(40)}"
    assert max(gap for _, gap in moved.values()) < 2.0, moved
    live = gateway_metric(gw, "pdserve_gateway_migrations_total")
    assert sum(v for k, v in live.items() if 'kind="live"' in k and 'reason="drain"' in k) == on[victim] >= 1, live
    assert not any(v for k, v in live.items() if 'kind="recompute"' in k), live
    assert pool_clean(survivor)
    status = {w["address"]: w["live_moves"] for w in
              requests.get(gw.url + "/status.json", timeout=30).json()["workers"]["decode"]}
    assert status[victim]["out"] == status[survivor]["in"] == on[victim]  # the status page's per-worker counts
    # The drained worker comes back for the next test, its pool as it started.
    proc.start()
    proc.wait_healthy(180)


def restart(system, gw, addr: str) -> None:
    proc = system.workers[addr]
    if proc.alive():
        proc.kill()
    proc.start()
    proc.wait_healthy(180)
    all_healthy(gw)


async def started_stream(gw, prompt: str, tokens: int = 1000, after: int = 20):
    """A greedy stream under way ((task of its text, its decode worker's address)) once `after` tokens came."""
    seen = asyncio.Event()
    task = asyncio.create_task(run_streams(gw, {"greedy": prompt}, lambda _, n: n >= after and seen.set(), tokens))
    await asyncio.wait_for(seen.wait(), 60)
    on = [w["address"] for w in server_info(gw)["workers"] if w["role"] == "decode" and w["in_flight"]]
    assert len(on) == 1, on
    return task, on[0]


def move(gw, url: str, **body) -> requests.Response:
    return requests.post(gw.url + "/workers/migrate", json={"url": url, **body}, timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def migrations(gw, kind: str, reason: str) -> float:
    return gateway_metric(gw, "pdserve_gateway_migrations_total").get(
        f'pdserve_gateway_migrations_total{{kind="{kind}",reason="{reason}"}}', 0.0)


async def test_an_operator_moves_a_stream_to_a_named_decode_worker(stack):
    system, gw, paddr = stack
    prompt = "An operator moves this one:"
    (reference, _), = (await run_streams(gw, {"greedy": prompt}, new_tokens=1000)).values()
    before = migrations(gw, "live", "rebalance")
    task, source = await started_stream(gw, prompt)
    target = next(a for a in system.workers if a not in (paddr, source))
    cli = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "pdserve", "debug", "migrate", source, "--count", "1", "--to", target,
                         "--gateway", gw.url], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PDSERVE_ADMIN_API_KEY": ADMIN_KEY})
    assert cli.returncode == 0 and "1 generation(s)" in cli.stdout, cli.stdout + cli.stderr
    (text, _), = (await asyncio.wait_for(task, 120)).values()
    assert text == reference
    assert migrations(gw, "live", "rebalance") == before + 1
    assert all(pool_clean(a) for a in (source, target))
    refused = move(gw, paddr, count=1)  # a prefill worker's requests do not move live
    assert refused.status_code == 400 and "decode" in refused.json()["message"]


@pytest.mark.parametrize("victim", ["source", "destination"])
async def test_a_worker_killed_mid_move_leaves_the_stream_whole_and_the_other_pool_clean(stack, victim):
    system, gw, paddr = stack
    prompt = f"A move whose {victim} dies:"
    (reference, _), = (await run_streams(gw, {"greedy": prompt}, new_tokens=1000)).values()
    recomputed = migrations(gw, "recompute", "rebalance") + migrations(gw, "recompute", "failure")
    task, source = await started_stream(gw, prompt)
    target = next(a for a in system.workers if a not in (paddr, source))
    assert move(gw, source, count=1, to=target).json()["frozen"]
    await asyncio.sleep(WRITE_DELAY_S / 2)  # the source's write of the pages is under way
    dead, alive = (source, target) if victim == "source" else (target, source)
    system.workers[dead].kill()
    (text, _), = (await asyncio.wait_for(task, 120)).values()
    assert text == reference  # continued by recomputation, nothing repeated or missing
    assert migrations(gw, "recompute", "rebalance") + migrations(gw, "recompute", "failure") > recomputed
    assert pool_clean(alive)
    restart(system, gw, dead)


async def test_a_client_gone_mid_move_frees_both_pools(stack):
    system, gw, paddr = stack
    task, source = await started_stream(gw, "A client leaves during the move:", tokens=1000)
    target = next(a for a in system.workers if a not in (paddr, source))
    assert move(gw, source, count=1, to=target).json()["frozen"]
    await asyncio.sleep(WRITE_DELAY_S / 2)
    task.cancel()  # the client closes its stream
    await asyncio.gather(task, return_exceptions=True)
    assert all(pool_clean(a) for a in (source, target))


async def test_a_drain_ends_n_above_one_at_once_for_recomputation(stack):
    """n = 2 does not move live (each choice has pages of its own): the draining worker ends it at once, and the
    gateway resumes both choices elsewhere, so the drain does not wait for it."""
    system, gw, paddr = stack
    client = openai.AsyncOpenAI(base_url=gw.base, api_key="none", max_retries=0, timeout=300)
    seen = asyncio.Event()

    async def two(count: list[int] | None = None) -> list[str]:
        texts = ["", ""]
        stream = await client.completions.create(model="default", prompt="Two choices, one drain:", n=2,
                                                 max_tokens=1000, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
            if count is not None:
                count[0] += 1
                if count[0] >= 40:
                    seen.set()
        return texts
    reference = await two()
    task = asyncio.create_task(two([0]))
    await asyncio.wait_for(seen.wait(), 60)
    (source,) = [w["address"] for w in server_info(gw)["workers"] if w["role"] == "decode" and w["in_flight"]]
    proc = system.workers[source]
    os.kill(proc.popen.pid, signal.SIGTERM)
    signalled = time.monotonic()
    await asyncio.to_thread(proc.popen.wait, 30)
    assert time.monotonic() - signalled < 10
    assert await asyncio.wait_for(task, 120) == reference
    restart(system, gw, source)


async def test_a_second_drain_during_the_first_finishes_every_stream(stack):
    """Both decode workers told to stop, one just after the other: the first's streams move to the second, whose
    drain has no peer left and lets them finish (as before live moves)."""
    system, gw, paddr = stack
    prompts = {kind: f"Two drains, {kind}:" for kind in ("greedy", "logprobs")}
    reference = await run_streams(gw, prompts, new_tokens=400)
    seen = asyncio.Event()
    counts = {}

    def on_token(kind: str, n: int) -> None:
        counts[kind] = n
        if len(counts) == len(prompts) and min(counts.values()) >= 20:
            seen.set()
    streams = asyncio.create_task(run_streams(gw, prompts, on_token, 400))
    await asyncio.wait_for(seen.wait(), 60)
    decodes = [a for a in system.workers if a != paddr]
    for addr in decodes:
        os.kill(system.workers[addr].popen.pid, signal.SIGTERM)
        await asyncio.sleep(1.0)  # the first's streams have moved; it is still shutting down
    moved = await asyncio.wait_for(streams, 120)
    assert {k: t for k, (t, _) in moved.items()} == {k: t for k, (t, _) in reference.items()}
    for addr in decodes:  # the last test of the module: they stay down
        await asyncio.to_thread(system.workers[addr].popen.wait, 30)
