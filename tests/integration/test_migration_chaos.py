"""Decode workers SIGKILLed at random points of long streams: the streams go on, token for token.

Real prefill, decode and gateway processes on a small random model, the workers in deterministic mode, so
that a greedy stream moved to another pair mid-way must produce exactly what an uninterrupted run produced. Two
prefill and three decode workers: two rounds of long streams each lose the busiest decode worker (the second round a
prefill worker too) at a random point, and no client sees an error, a repeated or a missing token. Then the
last decode worker dies under streams: with no pair left they end with a clear error within 5 s. Pages held
for requests are all freed on the workers still alive.

First, every kind of state a stream carries moves with it: greedy with logprobs, a JSON schema, penalties, a
seeded sample and n = 2, all running on one decode worker that is then killed, continue on the others with the
text and logprobs of an undisturbed run.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest
import requests

from fixtures import make_tiny_tokenizer
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams
from procs import Proc, free_port, start_worker

STREAMS = 8
TOKENS = 400
CLEAR_ERROR_WITHIN_S = 5.0


@dataclass
class Cluster:
    url: str
    prefills: dict[str, Proc]  # by gRPC address
    decodes: dict[str, Proc]
    gateway: Proc

    def procs(self) -> list[Proc]:
        return [self.gateway, *self.decodes.values(), *self.prefills.values()]


def make_model(out_dir: Path) -> Path:
    """A random 8-layer llama, hidden 128: slow enough per token that a client keeps up with its streams (the
    2-layer tiny model outruns the client, so a kill timed by what the client has seen lands too late), small
    enough to start in seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(out_dir)
    make_tiny_tokenizer(out_dir)
    return out_dir


def start_workers(role: str, count: int, *flags: str) -> dict[str, Proc]:
    workers = {}
    for _ in range(count):
        proc, addr = start_worker(role, None, *flags)
        workers[addr] = proc
    return workers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(make_model(tmp_path_factory.mktemp("migration") / "llama8"))
    flags = ("--model-path", model, "--dtype", "float32", "--transfer-backend", "tcp",
             "--enable-deterministic-inference")
    prefills = start_workers("prefill", 2, *flags)
    to_prefills = [flag for addr in prefills for flag in ("--prefill", addr)]
    decodes = start_workers("decode", 3, *flags, *to_prefills)
    port = free_port()
    gateway = Proc("gateway", ["gateway", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
                               "--health-check-interval", "0.5", *to_prefills,
                               *[flag for addr in decodes for flag in ("--decode", addr)]],
                   health_url=f"http://127.0.0.1:{port}/health").start({"OMP_NUM_THREADS": "1"})
    c = Cluster(f"http://127.0.0.1:{port}", prefills, decodes, gateway)
    try:
        for proc in c.procs():
            proc.wait_healthy(300)  # a first start may build the native kernels
        yield c
    finally:
        for proc in c.procs():
            proc.stop()


@dataclass
class Stream:
    """One client stream as the client saw it."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)  # from the logprobs: one entry per token, in order
    completion_tokens: int | None = None
    error: str | None = None
    ended_at: float = 0.0


async def stream(client: openai.AsyncOpenAI, prompt: str, out: Stream) -> Stream:
    try:
        chunks = await client.completions.create(
            model="default", prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            for choice in chunk.choices:
                out.text += choice.text or ""
                out.tokens += choice.logprobs.tokens if choice.logprobs else []
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        out.error = str(exc)
    out.ended_at = time.monotonic()
    return out


def prompts(round_: int) -> list[str]:
    return [f"Tell me story number {round_}-{i} about a dragon." for i in range(STREAMS)]


async def run_streams(url: str, texts: list[str], kill=None) -> list[Stream]:
    """Stream every prompt at once; `kill(streams)` runs beside them."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    outs = [Stream() for _ in texts]
    try:
        tasks = [asyncio.create_task(stream(client, t, o)) for t, o in zip(texts, outs)]
        if kill is not None:
            await kill(outs)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await client.close()


async def kill_at(outs: list[Stream], tokens: int, *procs: Proc) -> float:
    """SIGKILL `procs` once the furthest stream has `tokens` tokens (so that none has finished); when."""
    while max(len(o.tokens) for o in outs) < tokens:
        await asyncio.sleep(0.005)
    for proc in procs:
        proc.kill()
    return time.monotonic()


async def busiest(url: str, addresses: list[str]) -> str:
    """The decode worker with the most of the gateway's streams on it now (the gateway counts them itself, so asking
    costs no wait on a busy worker's engine): the router may have put every stream on one worker (their prompts
    share a prefix), and killing an idle one would test nothing."""
    def ask() -> dict[str, int]:
        workers = requests.get(url + "/get_server_info", timeout=10).json()["workers"]
        return {w["address"]: w["in_flight"] for w in workers if w["role"] == "decode"}
    running = await asyncio.to_thread(ask)
    return max(addresses, key=lambda a: running.get(a, 0))


def migrations(url: str) -> float:
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("pdserve_gateway_migrations_total"))


def wait_reported_idle(url: str, timeout: float = 10.0) -> None:
    """Until the gateway's view of every healthy decode worker's load is idle: a load report taken during the
    previous run would steer the next run's streams away from that worker (and the kill might then miss)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = requests.get(url + "/get_server_info", timeout=10).json()["workers"]
        if all(not w["running"] and not w["waiting"] for w in workers if w["role"] == "decode" and w["healthy"]):
            return
        time.sleep(0.1)


def pool_stats(addr: str, timeout: float = 15.0) -> pb.PoolStats:
    """The worker's pool once it holds no pages for requests (or its last Stats after `timeout`)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.WorkerStub(channel)
        while True:
            stats = stub.Stats(pb.Empty(), timeout=10)
            if stats.used_pages == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)


# ---------------------------------------------------------------- every kind of stream moves
KIND_TOKENS = 200
STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 120, "maxLength": 120}},
         "required": ["story"], "additionalProperties": False}
KINDS = {  # name -> the request's parameters beside prompt, max_tokens and stream
    "greedy_logprobs": dict(temperature=0, logprobs=3, extra_body={"ignore_eos": True}),
    "json": dict(temperature=0, extra_body={"json_schema": json.dumps(STORY)}),
    "penalties": dict(temperature=0, frequency_penalty=1.2, presence_penalty=0.6, extra_body={"ignore_eos": True}),
    "seeded": dict(temperature=1.0, seed=11, extra_body={"ignore_eos": True}),
    "n2": dict(temperature=0.9, seed=5, n=2, extra_body={"ignore_eos": True}),
}
# One long prefix: the router keeps the prompts on the decode worker that holds it (five requests are within its
# balance margin), so that killing that worker moves every kind of stream as a rule.
PREFIX = "Once upon a time, in a kingdom of mountains and rivers, there lived a dragon who loved stories. " * 3


async def stream_kind(client: openai.AsyncOpenAI, kind: str, outs: dict[tuple[str, int], Stream]) -> None:
    params = KINDS[kind]
    for index in range(params.get("n", 1)):
        outs[kind, index] = Stream()
    try:
        chunks = await client.completions.create(model="default", prompt=f"{PREFIX}A {kind} story.",
                                                 max_tokens=KIND_TOKENS, stream=True, **{"logprobs": 0, **params})
        async for chunk in chunks:
            for choice in chunk.choices:
                out = outs[kind, choice.index]
                out.text += choice.text or ""
                lps = choice.logprobs
                out.tokens += list(zip(lps.tokens, lps.token_logprobs, lps.top_logprobs or [None] * len(lps.tokens)))
                out.completion_tokens = choice.finish_reason or out.completion_tokens
    except openai.APIError as exc:
        for index in range(params.get("n", 1)):
            outs[kind, index].error = str(exc)


async def run_kinds(url: str, kill=None) -> dict[tuple[str, int], Stream]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    outs: dict[tuple[str, int], Stream] = {}
    try:
        tasks = [asyncio.create_task(stream_kind(client, kind, outs)) for kind in KINDS]
        if kill is not None:
            await kill(outs)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return outs
    finally:
        await client.close()


def in_flight(url: str) -> dict[str, int]:
    workers = requests.get(url + "/get_server_info", timeout=10).json()["workers"]
    return {w["address"]: w["in_flight"] for w in workers if w["role"] == "decode" and w["healthy"]}


def warm_grammar(addr: str) -> None:
    """A grammar's first use on a worker loads its tokenizer and compiles it, tens of seconds on a loaded 2-core
    machine: each decode worker compiles the JSON stream's schema once, so that the move is what is timed. Sent as
    a resumed generation of one choice with no output yet, which a decode worker computes itself."""
    params = SamplingParams(max_new_tokens=1, json_schema=json.dumps(STORY))
    request = pb.GenerateRequest(rid=f"warm-{addr}", input_ids=[1, 2, 3], sampling=params_to_proto(params),
                                 resume=[pb.ResumedChoice(index=0)])
    with grpc.insecure_channel(addr) as channel:
        replies = list(pb_grpc.WorkerStub(channel).Generate(request, timeout=180))
    assert [len(c.token_ids) for r in replies for c in r.choices] == [1] and replies[-1].choices[0].finish_reason


def test_every_kind_of_stream_continues_unchanged_after_its_decode_worker_is_killed(cluster):
    with ThreadPoolExecutor(len(cluster.decodes)) as pool:
        list(pool.map(warm_grammar, cluster.decodes))
    reference = asyncio.run(run_kinds(cluster.url))
    assert all(r.error is None and len(r.tokens) > 40 for r in reference.values()), reference
    wait_reported_idle(cluster.url)
    before, at_kill, placed = migrations(cluster.url), {}, {}

    async def kill(outs: dict[tuple[str, int], Stream]) -> None:
        while len(outs) < len(reference) or min(len(o.tokens) for o in outs.values()) < 10:
            await asyncio.sleep(0.005)
        placed.update(await asyncio.to_thread(in_flight, cluster.url))  # the gateway's count, as it routes
        victim = max(placed, key=placed.get)
        cluster.decodes[victim].kill()
        at_kill.update({key: len(o.tokens) for key, o in outs.items()})
        placed["victim"] = victim

    try:
        moved = asyncio.run(run_kinds(cluster.url, kill))
    finally:
        if "victim" in placed:  # the next test starts from three decode workers
            victim = placed["victim"]
            cluster.decodes[victim].start().wait_healthy(120)
            deadline = time.monotonic() + 30
            while victim not in in_flight(cluster.url) and time.monotonic() < deadline:
                time.sleep(0.1)
    # The router placed them, as a rule all on one worker (their shared prefix); a stream the gateway had taken to
    # its end meanwhile (the client may lag far behind on a loaded machine) is not counted there any more. Each
    # stream there moved at most once, and some did.
    assert 1 <= migrations(cluster.url) - before <= placed[placed["victim"]], (placed, at_kill)
    for key, r in reference.items():
        m = moved[key]
        assert m.error is None, (key, m.error)
        assert m.tokens == r.tokens, key  # every token, its logprob and top logprobs: none repeated or missing
        assert (m.text, m.completion_tokens) == (r.text, r.completion_tokens), key
    assert reference["n2", 0].text != reference["n2", 1].text
    assert len(json.loads(reference["json", 0].text)["story"]) == 120
    assert all(top for _, _, top in reference["greedy_logprobs", 0].tokens)  # by text: tokens alike may merge


# ---------------------------------------------------------------- decode workers killed at random points
def test_streams_survive_decode_workers_killed_at_random_points(cluster):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    decodes, prefills = list(cluster.decodes), list(cluster.prefills)
    rng.shuffle(prefills)
    for round_ in (1, 2):
        texts = prompts(round_)
        reference = asyncio.run(run_streams(cluster.url, texts))
        assert all(r.error is None and r.completion_tokens == TOKENS for r in reference), reference
        # The kill lands in the first tenth of the streams as the client sees them: the tiny model decodes up to
        # six times faster than the gateway streams to the client on two busy cores (the gateway's gRPC reads
        # are buffered), so a worker killed when the client is at a later token may have sent everything.
        before, at = migrations(cluster.url), rng.randrange(1, TOKENS // 10)
        wait_reported_idle(cluster.url)

        async def kill(outs: list[Stream]) -> None:
            while min(len(o.tokens) for o in outs) < 1:  # every stream placed and running: pick the victim now
                await asyncio.sleep(0.005)
            victim = await busiest(cluster.url, decodes)
            decodes.remove(victim)
            extra = [cluster.prefills[prefills[0]]] if round_ == 2 else []  # round 2: a prefill worker too
            await kill_at(outs, at, cluster.decodes[victim], *extra)

        killed = asyncio.run(run_streams(cluster.url, texts, kill))
        where = f"(round {round_}, killed at {at} tokens, seed {seed})"
        assert [k.error for k in killed] == [None] * STREAMS, where
        assert [k.completion_tokens for k in killed] == [TOKENS] * STREAMS, where
        for k, r in zip(killed, reference):
            assert k.tokens == r.tokens and len(k.tokens) == TOKENS, where  # nothing repeated, missing, changed
            assert k.text == r.text, where
        assert migrations(cluster.url) > before, f"no stream was moved {where}"

    [last], prefill = decodes, prefills[1]
    stats = pool_stats(last), pool_stats(prefill)
    assert all((s.used_pages, s.integrity_ok) == (0, True) for s in stats), stats

    # The last decode worker dies too: nothing can continue the streams.
    killed_at = 0.0

    async def kill_last(outs: list[Stream]) -> None:
        nonlocal killed_at
        killed_at = await kill_at(outs, 10, cluster.decodes[last])

    wait_reported_idle(cluster.url)
    outs = asyncio.run(run_streams(cluster.url, prompts(3)[:4], kill_last))
    for o in outs:
        assert o.error is not None and "worker" in o.error, o
        assert o.ended_at - killed_at < CLEAR_ERROR_WITHIN_S, (o.ended_at - killed_at, o.error)
        assert len(o.tokens) < TOKENS
    assert pool_stats(prefill).used_pages == 0
