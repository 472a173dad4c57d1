"""A tensor-parallel worker over two nodes, both on this machine over loopback: node 0 runs the worker (its front,
its engine process as rank 0), node 1 runs only rank 1 (`--node-rank 1`: no endpoint), and they meet at
--dist-init-addr. What a user sees: the whole model's greedy answer of one process, token for token, alone and
batched, from a colocated worker and from a decode worker over two nodes fed by a prefill worker; and when node
1's process is killed, node 0's worker exits within seconds for its supervisor to start it again, leaving no
process behind. Every process holds the cluster token, as the platform starts them: the posts, the settings and
the link between the nodes are the authenticated ones, and a node 1 with another token is refused at rank 0's
rendezvous gate.

The default model in fp32 (its 3 KV-head groups split 2 + 1 over the two nodes), as the other TP tests.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto as to_proto
from pdserve.shared.cluster_auth import METADATA_KEY, TOKEN_ENV
from pdserve.shared.sampling_params import SamplingParams
from procs import Proc, alive, children, free_port, greedy_in_one_process, start_worker
from test_pd_workers import FP32, QUESTIONS

NEW_TOKENS = 16
GONE_WITHIN_S = 10.0
TOKEN = "test-cluster-token-5d27e8"
ENV = {TOKEN_ENV: TOKEN}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS[:3]]


@pytest.fixture(scope="module")
def one_process(default_model_dir, prompts) -> list[list[int]]:
    return greedy_in_one_process(default_model_dir, prompts, NEW_TOKENS)


def two_nodes(role: str, both: tuple = (), node0: tuple = (), node1: tuple = (), node1_env: dict = ENV) \
        -> tuple[Proc, str, Proc]:
    """Node 0's worker (its process, its gRPC address) and node 1's process, meeting on a free loopback port;
    `both`: flags of both (every node of a worker is started with the same flags but --node-rank)."""
    meet = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}", *FP32, *both]
    worker, addr = start_worker(role, None, *meet, "--node-rank", "0", *node0, env=ENV)
    transfer = ["--transfer-port", str(free_port())] if role == "decode" else []
    other = Proc(f"{role} node 1", [role, *meet, "--node-rank", "1", "--threads", "1", "--max-total-tokens", "8192",
                                    *transfer, *node1]).start(node1_env)
    return worker, addr, other


async def generate(addr: str, ids: list[int], prefill: str = "") -> list[int]:
    """A greedy answer from a worker, asked as the gateway asks: with the cluster token."""
    sampling = to_proto(SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    request = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling=sampling, prefill_addr=prefill)
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(addr) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(request, timeout=120, metadata=((METADATA_KEY, TOKEN),)):
            tokens += [t for c in msg.choices for t in c.token_ids]
    return tokens


def answers(addr: str, prompts, prefill: str = "") -> tuple[list, list]:
    async def run():
        alone = [await generate(addr, ids, prefill=prefill) for ids in prompts]
        together = await asyncio.gather(*(generate(addr, ids, prefill=prefill) for ids in prompts))
        return alone, list(together)
    return asyncio.run(run())


def test_a_worker_over_two_nodes_answers_as_one_process_and_goes_down_without_node_1(prompts, one_process):
    node0, addr, node1 = two_nodes("colocated", both=("--dist-timeout", "5"))
    try:
        node0.wait_healthy(120)
        engine, = children(node0.popen.pid)
        assert children(engine) == []  # rank 1 is node 1's
        rank1, = children(node1.popen.pid)
        assert "tensor-parallel node 1 of 2 (rank 1 of 2)" in node1.tail()
        assert "tensor-parallel over 2 ranks" in node0.tail()
        alone, together = answers(addr, prompts)
        assert alone == one_process
        assert together == one_process
        os.kill(node1.popen.pid, signal.SIGKILL)  # node 1's process alone: its rank dies with it
        killed = time.monotonic()
        assert node0.popen.wait(GONE_WITHIN_S + 5) != 0  # for its supervisor to start it again
        assert time.monotonic() - killed < GONE_WITHIN_S
        assert "tensor-parallel node 1 (127.0.0.1) is gone" in node0.tail(20)
        deadline = time.monotonic() + 5
        while (alive(engine) or alive(rank1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(engine) and not alive(rank1)
    finally:
        node0.kill()
        node1.kill()


def test_a_decode_worker_over_two_nodes_takes_its_prompts_from_a_prefill_worker(prompts, one_process):
    prefill, paddr = start_worker("prefill", None, *FP32, "--transfer-backend", "tcp", env=ENV)
    node0 = node1 = None
    try:
        prefill.wait_healthy()
        node0, daddr, node1 = two_nodes("decode", both=("--transfer-backend", "tcp", "--local-prefill-max-tokens", "0"),
                                        node0=("--prefill", paddr))
        node0.wait_healthy(120)
        alone, together = answers(daddr, prompts, prefill=paddr)
        assert alone == one_process  # each decode rank got its KV heads from the prefill worker over TCP
        assert together == one_process
        node1.stop()  # asked to stop, it says so, and the worker goes down with it
        assert node0.popen.wait(GONE_WITHIN_S) != 0
        assert "node 1 was asked to stop" in node0.tail(20)
    finally:
        for proc in (node0, node1, prefill):
            if proc is not None:
                proc.kill()


def test_nodes_started_with_other_flags_are_a_start_error_naming_them():
    node0, _, node1 = two_nodes("colocated", node1=("--page-size", "32"))
    try:
        assert node0.popen.wait(120) != 0
        assert node1.popen.wait(30) != 0
        said = "node 1 was started with other flags than node 0: cache (CacheConfig(page_size=32"
        assert said in node0.tail(20)
        assert said in node1.tail(20)  # rank 0 told it why before it left
    finally:
        node0.kill()
        node1.kill()


def test_a_node_with_another_cluster_token_is_refused_at_the_rendezvous():
    node0, _, node1 = two_nodes("colocated", node1_env={TOKEN_ENV: "another-token"})
    try:
        assert node1.popen.wait(120) != 0
        assert "refused this node: its answer does not prove this worker's cluster token" in node1.tail(20)
        assert "tensor-parallel rendezvous: refused a connection from 127.0.0.1" in node0.tail(40)
        assert TOKEN not in node0.tail(200) and node0.popen.poll() is None  # it waits for a node that proves it
    finally:
        node0.kill()
        node1.kill()
