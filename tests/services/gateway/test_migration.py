"""Migration over in-process gRPC workers that die mid-stream: the stream goes on elsewhere, exactly.

The stand-in workers run a "model" whose next token is a function of the choice and its whole sequence so far,
so a continuation that resumes each choice from its output so far (GenerateRequest.resume) produces exactly the
tokens an uninterrupted run would have: any repeated, missing or misplaced token changes the output.
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
from pdserve.services.gateway.workers.job import Job
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.workers.migration import continuation, why_not_movable
from pdserve.services.gateway.workers.router import Router
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers.pool import WorkerPool
from pdserve.shared.sampling_params import SamplingParams
from harness import Multiplexed


def next_token(seq: list[int], index: int = 0) -> int:
    return 300 + (sum(seq) * 31 + len(seq) + 7 * index) % 200


def reference(prompt: list[int], count: int, index: int = 0) -> list[int]:
    seq = list(prompt)
    for _ in range(count):
        seq.append(next_token(seq, index))
    return seq[len(prompt):]


class ModelWorker(Multiplexed, pb_grpc.WorkerServicer):
    """Generates `next_token` one per message; dies (its whole server stops) after `die_after` messages."""

    def __init__(self, die_after: int | None = None, delay: float = 0.005, role: str = "colocated") -> None:
        self.die_after, self.delay, self.role = die_after, delay, role
        self.server: grpc.aio.Server | None = None
        # (prompt, params, {choice: its output so far}) of each Generate call
        self.requests: list[tuple[list[int], SamplingParams, dict[int, list[int]]]] = []
        self.rids: list[str] = []
        self.stopping: asyncio.Future | None = None
        self.draining = False  # shutting down: new calls refused, those in progress go on

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down")
        params = params_from_proto(request.sampling)
        resume = {c.index: list(c.output_ids) for c in request.resume} or {i: [] for i in range(params.n)}
        self.requests.append((list(request.input_ids), params, resume))
        self.rids.append(request.rid)
        seqs = {i: list(request.input_ids) + out for i, out in resume.items()}
        for i in range(params.max_new_tokens):
            if self.die_after is not None and i == self.die_after:
                # The process is gone: its streams break, its port refuses. (Stopped from a task of its own:
                # stopping cancels this handler.)
                self.stopping = asyncio.ensure_future(self.server.stop(0))
                await asyncio.sleep(10)
            deltas = []
            for index, seq in seqs.items():
                if len(seq) - len(request.input_ids) >= params.max_new_tokens:
                    continue
                seq.append(next_token(seq, index))
                last = len(seq) - len(request.input_ids) == params.max_new_tokens
                deltas.append(pb.ChoiceDelta(index=index, token_ids=[seq[-1]],
                                             logprobs=[-0.5] if params.return_logprob else [],
                                             finish_reason="length" if last else "", matched_stop_token=-1))
            if not deltas:
                return
            yield pb.GenerateResponse(prompt_tokens=len(request.input_ids), cached_tokens=1, choices=deltas)
            await asyncio.sleep(self.delay)

    async def Health(self, request, context):
        return pb.HealthReply(ok=not self.draining, role=self.role, draining=self.draining)

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


def total(counter) -> float:
    """A counter's count over all its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


async def stream(gen) -> tuple[list[int], str, list]:
    ids, text, updates = [], "", []
    async for u in gen.updates():
        ids += u.token_ids
        text += u.text
        updates.append(u)
    return ids, text, updates


# ---------------------------------------------------------------- what a continuation asks for
def test_a_continuation_resumes_each_running_choice_from_its_output():
    resume = continuation([[9, 8], None, []])
    assert [(c.index, list(c.output_ids)) for c in resume] == [(0, [9, 8]), (2, [])]  # choice 1 has ended


@pytest.mark.parametrize("params", [SamplingParams(n=2), SamplingParams(regex="a+"),
                                    SamplingParams(frequency_penalty=0.5), SamplingParams(presence_penalty=-1.0),
                                    SamplingParams(repetition_penalty=1.3, seed=3, temperature=1.0)])
def test_every_parameter_moves(params):
    assert why_not_movable(params) is None


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
        [(sent, params, resume)] = spare.requests
        assert sent == j.input_ids and resume == {0: expected[:12]}  # the prompt, and the output to continue
        assert params == j.params  # budgets count from the original start: the worker counts the resumed output
        # A new id for the new attempt: what a worker keeps of the old one (an abort remembered for a request
        # that had not reached it yet) cannot refuse the continuation.
        assert (dying.rids, spare.rids) == ([j.rid], [f"{j.rid}.1"])
        assert total(backend.metrics.migrations) == 1 and backend.metrics.retries._value.get() == 0
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
        assert total(backend.metrics.migrations) == 1
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
        assert total(backend.metrics.migrations) == 2
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


async def test_n_choices_with_penalties_and_a_grammar_move_each_from_its_own_output(tok, workers):
    spare = ModelWorker()
    addrs = [await workers.start(ModelWorker(die_after=9)), await workers.start(spare)]
    backend = await make_backend(tok, {"colocated": addrs})
    j = job(tok, n=2, frequency_penalty=0.5, presence_penalty=0.3, regex="[a-z ]+", temperature=0.8, seed=3)
    try:
        with backend.generation(j) as gen:
            results = await gen.collect()
        for index, result in enumerate(results):
            assert result.token_ids == reference(j.input_ids, 40, index), index  # none repeated or missing
            assert result.finish_reason == "length"
        assert reference(j.input_ids, 40, 0) != reference(j.input_ids, 40, 1)
        [(sent, params, resume)] = spare.requests
        assert sent == j.input_ids and params == j.params
        assert resume == {i: reference(j.input_ids, 9, i) for i in range(2)}
        assert total(backend.metrics.migrations) == 1 and backend.metrics.retries._value.get() == 0
    finally:
        await backend.pool.close()


async def test_a_prefill_worker_that_dies_after_the_first_output_leaves_decoding_streams_alone(tok, workers):
    prefill = ModelWorker(role="prefill")
    decode = ModelWorker(delay=0.02, role="decode")
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
        assert total(backend.metrics.migrations) == 0
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
        assert len(models[busy].requests) == 1 and total(backend.metrics.migrations) == 0
        new = Job("r2", tok.encode("another prompt"), SamplingParams(temperature=0.0, max_new_tokens=5))
        for _ in range(2):  # round robin would pick the draining worker for one of them
            with backend.generation(new) as gen2:
                await gen2.collect()
        assert len(models[busy].requests) == 1 and len(models[1 - busy].requests) == 2
    finally:
        await backend.pool.close()
