"""Migration over in-process gRPC workers that die mid-stream: the stream goes on elsewhere, exactly.

The stand-in workers run a "model" whose next token is a function of the whole sequence so far, so a
continuation sent the right prompt (the original plus what was already out) produces exactly the tokens an
uninterrupted run would have: any repeated, missing or misplaced token changes the output.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_from_proto
from pdserve.services.gateway.workers.backend import Backend, BackendSettings
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.workers.generation import Restart
from pdserve.services.gateway.workers.job import Job
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.workers.migration import continuation, why_not_movable
from pdserve.services.gateway.workers.router import Router
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers.pool import WorkerPool
from pdserve.shared.sampling_params import SamplingParams
from harness import Multiplexed


def next_token(seq: list[int]) -> int:
    return 300 + (sum(seq) * 31 + len(seq)) % 200


def reference(prompt: list[int], count: int) -> list[int]:
    seq = list(prompt)
    for _ in range(count):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class ModelWorker(Multiplexed, pb_grpc.WorkerServicer):
    """Generates `next_token` one per message; dies (its whole server stops) after `die_after` messages."""

    def __init__(self, die_after: int | None = None, delay: float = 0.005) -> None:
        self.die_after, self.delay = die_after, delay
        self.server: grpc.aio.Server | None = None
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.rids: list[str] = []
        self.stopping: asyncio.Future | None = None
        self.draining = False  # shutting down: new calls refused, those in progress go on

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down")
        params = params_from_proto(request.sampling)
        self.requests.append((list(request.input_ids), params))
        self.rids.append(request.rid)
        seq = list(request.input_ids)
        for i in range(params.max_new_tokens):
            if self.die_after is not None and i == self.die_after:
                # The process is gone: its streams break, its port refuses. (Stopped from a task of its own:
                # stopping cancels this handler.)
                self.stopping = asyncio.ensure_future(self.server.stop(0))
                await asyncio.sleep(10)
            seq.append(next_token(seq))
            last = i == params.max_new_tokens - 1
            yield pb.GenerateResponse(prompt_tokens=len(request.input_ids), cached_tokens=1, choices=[
                pb.ChoiceDelta(index=0, token_ids=[seq[-1]], logprobs=[-0.5] if params.return_logprob else [],
                               finish_reason="length" if last else "", matched_stop_token=-1)])
            await asyncio.sleep(self.delay)

    async def Health(self, request, context):
        return pb.HealthReply(ok=not self.draining, role="colocated", draining=self.draining)

    async def Load(self, request, context):
        return pb.LoadReply(free_pages=100, total_pages=100)

    async def Info(self, request, context):
        return pb.InfoReply(max_running_requests=8, context_length=8192, compat=pb.Compat(page_size=16))


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return ModelTokenizer(default_model_dir)


class Workers:
    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []

    async def start(self, worker: ModelWorker) -> str:
        server = worker.server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop(0) for s in self.servers), return_exceptions=True)


@pytest.fixture
async def workers():
    w = Workers()
    yield w
    await w.stop()


async def make_backend(tok, specs: dict[str, list[str]], **settings) -> Backend:
    pool = WorkerPool(specs)
    await pool.start()
    return Backend(tok, pool, Router(pool, "round_robin"), GatewayMetrics(),
                   BackendSettings(stall_timeout_s=5, **settings))


def job(tok, **params) -> Job:
    return Job("r1", tok.encode("hello there"), SamplingParams(**{"temperature": 0.0, "max_new_tokens": 40,
                                                                   **params}))


async def stream(gen) -> tuple[list[int], str, list]:
    ids, text, updates = [], "", []
    async for u in gen.updates():
        ids += u.token_ids
        text += u.text
        updates.append(u)
    return ids, text, updates


# ---------------------------------------------------------------- what a continuation asks for
def test_a_continuation_sends_prompt_and_output_with_the_rest_of_the_budget():
    params = SamplingParams(temperature=0.7, seed=5, max_new_tokens=100, min_new_tokens=30, return_logprob=True,
                            logprob_start_len=0, stop_token_ids=(7,))
    c = continuation([1, 2, 3], [9, 8], params)
    assert c.input_ids == [1, 2, 3, 9, 8]
    assert (c.params.max_new_tokens, c.params.min_new_tokens, c.params.logprob_start_len) == (98, 28, -1)
    assert (c.params.seed, c.params.stop_token_ids, c.params.return_logprob) == (5, (7,), True)
    assert continuation([1], list(range(40)), params).params.min_new_tokens == 0


@pytest.mark.parametrize("params, word", [(SamplingParams(n=2), "n > 1"), (SamplingParams(regex="a+"), "grammar"),
                                          (SamplingParams(frequency_penalty=0.5), "penalties"),
                                          (SamplingParams(presence_penalty=-1.0), "penalties")])
def test_what_cannot_move_says_why(params, word):
    assert word in why_not_movable(params)
    assert why_not_movable(SamplingParams(repetition_penalty=1.3, seed=3, temperature=1.0)) is None


# ---------------------------------------------------------------- streams that lose their worker
async def test_a_stream_whose_worker_dies_goes_on_elsewhere_token_for_token(tok, workers):
    dying, spare = ModelWorker(die_after=12), ModelWorker()
    addrs = [await workers.start(dying), await workers.start(spare)]
    backend = await make_backend(tok, {"colocated": addrs})
    j = job(tok, min_new_tokens=20, return_logprob=True, logprob_start_len=0)
    try:
        with backend.generation(j) as gen:
            ids, text, updates = await stream(gen)
        expected = reference(j.input_ids, 40)
        assert ids == expected
        assert text == tok.decode(expected)
        assert updates[-1].finish_reason == "length" and all(u.finish_reason is None for u in updates[:-1])
        assert len([lp for u in updates for lp in u.logprobs]) == 40  # new tokens' logprobs still come
        assert (gen.prompt_tokens, gen.completion_tokens) == (len(j.input_ids), 40)  # usage: the client's prompt
        [(sent, params)] = spare.requests
        assert sent == j.input_ids + expected[:12]
        assert (params.max_new_tokens, params.min_new_tokens, params.logprob_start_len) == (28, 8, -1)
        # A new id for the new attempt: what a worker keeps of the old one (an abort remembered for a request
        # that had not reached it yet) cannot refuse the continuation.
        assert (dying.rids, spare.rids) == ([j.rid], [f"{j.rid}.1"])
        assert backend.metrics.migrations._value.get() == 1 and backend.metrics.retries._value.get() == 0
        assert all(w.in_flight == 0 and not w.on_out for w in backend.pool.workers.values())
    finally:
        await backend.pool.close()


async def test_a_whole_answer_is_continued_too_not_started_over(tok, workers):
    addrs = [await workers.start(ModelWorker(die_after=7)), await workers.start(ModelWorker())]
    backend = await make_backend(tok, {"colocated": addrs})
    try:
        with backend.generation(job(tok)) as gen:
            [result] = await gen.collect()
        assert result.token_ids == reference(gen.job.input_ids, 40) and result.finish_reason == "length"
        assert backend.metrics.migrations._value.get() == 1
    finally:
        await backend.pool.close()


async def test_migrations_are_bounded(tok, workers):
    addrs = [await workers.start(ModelWorker(die_after=3)) for _ in range(3)] + [await workers.start(ModelWorker())]
    backend = await make_backend(tok, {"colocated": addrs}, max_migrations=2)
    try:
        with backend.generation(job(tok)) as gen:
            with pytest.raises(ApiError) as info:
                await stream(gen)
        assert info.value.status == 503 and "moved to another worker 2 times" in info.value.message
        assert backend.metrics.migrations._value.get() == 2
    finally:
        await backend.pool.close()


async def test_with_no_pair_left_the_stream_ends_with_a_clear_503_at_once(tok, workers):
    addrs = [await workers.start(ModelWorker(die_after=5)), await workers.start(ModelWorker(die_after=5))]
    backend = await make_backend(tok, {"colocated": addrs})
    try:
        with backend.generation(job(tok)) as gen:
            seen: list[int] = []
            with pytest.raises(ApiError) as info:
                async for u in gen.updates():
                    seen += u.token_ids
                    if len(seen) == 10:  # the second worker is about to die: nothing is left then
                        died = time.monotonic()
        assert time.monotonic() - died < 5
        assert info.value.status == 503 and "no other worker pair can continue it" in info.value.message
        assert seen == reference(gen.job.input_ids, 10)  # never a repeated or missing token before the error
    finally:
        await backend.pool.close()


async def test_what_cannot_move_fails_the_stream(tok, workers):
    spare = ModelWorker()
    addrs = [await workers.start(ModelWorker(die_after=4)), await workers.start(spare)]
    backend = await make_backend(tok, {"colocated": addrs})
    try:
        with backend.generation(job(tok, frequency_penalty=0.5)) as gen:
            with pytest.raises(ApiError) as info:
                await stream(gen)
        assert info.value.status == 503 and "frequency or presence penalties" in info.value.message
        assert not spare.requests and backend.metrics.migrations._value.get() == 0
    finally:
        await backend.pool.close()


async def test_what_cannot_move_starts_over_while_nothing_reached_the_client(tok, workers):
    addrs = [await workers.start(ModelWorker(die_after=4)), await workers.start(ModelWorker())]
    backend = await make_backend(tok, {"colocated": addrs})
    try:
        with backend.generation(job(tok, frequency_penalty=0.5)) as gen:
            restarts = [isinstance(u, Restart) async for u in gen.run(restartable=True)]
        assert restarts.count(True) == 1 and gen.completion_tokens == 40
        assert backend.metrics.migrations._value.get() == 0 and backend.metrics.retries._value.get() == 1
    finally:
        await backend.pool.close()


async def test_a_prefill_worker_that_dies_after_the_first_output_leaves_decoding_streams_alone(tok, workers):
    prefill = ModelWorker()
    decode = ModelWorker(delay=0.02)
    paddr, daddr = await workers.start(prefill), await workers.start(decode)
    backend = await make_backend(tok, {"prefill": [paddr], "decode": [daddr]})
    try:
        with backend.generation(job(tok)) as gen:
            updates = gen.updates()
            await updates.__anext__()
            await prefill.server.stop(0)
            backend.pool.take_out(backend.pool.workers[paddr], "test: the prefill worker died")
            rest = [u async for u in updates]
        ids = [t for u in rest for t in u.token_ids]
        assert len(ids) == 39 and gen.completion_tokens == 40
        assert backend.metrics.migrations._value.get() == 0
        assert all(w.in_flight == 0 and not w.on_out for w in backend.pool.workers.values())
    finally:
        await backend.pool.close()


async def test_a_draining_worker_finishes_its_streams_and_gets_no_new_ones(tok, workers):
    models = [ModelWorker(delay=0.02), ModelWorker(delay=0.02)]
    addrs = [await workers.start(m) for m in models]
    backend = await make_backend(tok, {"colocated": addrs})
    try:
        with backend.generation(job(tok)) as gen:
            updates = gen.updates()
            ids = list((await updates.__anext__()).token_ids)
            busy = addrs.index(gen.pair.generate.address)
            models[busy].draining = True
            await backend.pool.check_all()  # what the health loop does within a second
            assert not backend.pool.workers[addrs[busy]].healthy
            ids += [t async for u in updates for t in u.token_ids]
        assert ids == reference(gen.job.input_ids, 40)  # finished where it ran, untouched
        assert len(models[busy].requests) == 1 and backend.metrics.migrations._value.get() == 0
        new = Job("r2", tok.encode("another prompt"), SamplingParams(temperature=0.0, max_new_tokens=5))
        for _ in range(2):  # round robin would pick the draining worker for one of them
            with backend.generation(new) as gen2:
                await gen2.collect()
        assert len(models[busy].requests) == 1 and len(models[1 - busy].requests) == 2
    finally:
        await backend.pool.close()
