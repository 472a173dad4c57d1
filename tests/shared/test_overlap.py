"""Overlapped decode steps (shared/overlap.py) on the CPU: step i+1 is launched before step i's tokens are read.

The overlapped order must change nothing a client sees: under --enable-deterministic-inference every request
gets the tokens and logprobs of the plain order, bit for bit, whatever finishes, arrives, is retracted or
aborted in between; outputs never carry a placeholder; pages stay accounted for while a step is in flight.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66], [1, 2, 3], [400, 401, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           [7, 7, 7, 7, 7], [30, 31], [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105]]


def engine_for(model_dir, overlap: str, pages: int = 96, **config) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32", overlap_schedule=overlap,
                                deterministic=True, cache=CacheConfig(page_size=4, max_total_tokens=4 * pages),
                                scheduler=SchedulerConfig(max_prefill_tokens=64), **config))


class Client:
    """Collects each request's outputs as a client would see them, and checks the pool after every step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[tuple[str, int], list] = {}
        self.finish: dict[tuple[str, int], str | None] = {}
        self.in_flight_steps = 0

    def add(self, rid: str, ids: list[int], **params) -> None:
        def collect(out):
            assert all(t >= 0 for t in out.token_ids), "a placeholder reached a client"
            key = (out.rid, out.index)
            lps = out.logprobs or [None] * len(out.token_ids)
            self.tokens.setdefault(key, []).extend(
                (t, lp and (lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs))) for t, lp in zip(out.token_ids, lps))
            if out.finish_reason is not None:
                self.finish[key] = out.finish_reason
        self.engine.add_request(Req(rid=rid, input_ids=list(ids), on_output=collect, params=SamplingParams(**params)))

    def step(self) -> None:
        self.engine.step()
        self.in_flight_steps += self.engine.overlap.pending is not None
        report = self.engine.scheduler.check_integrity()
        assert report.ok, report.message

    def run(self, arrivals: dict[int, list[tuple]] | None = None) -> Client:
        """Step until idle; arrivals[k]: requests (rid, ids, params) added before step k."""
        arrivals, k = dict(arrivals or {}), 0
        while self.engine.has_work() or arrivals:
            for rid, ids, params in arrivals.pop(k, []):
                self.add(rid, ids, **params)
            if self.engine.has_work():
                self.step()
            k += 1
        return self


def both(model_dir, requests: list[tuple], arrivals: dict | None = None, **config) -> tuple[Client, Client]:
    runs = []
    for overlap in ("off", "on"):
        client = Client(engine_for(model_dir, overlap, **config))
        for rid, ids, params in requests:
            client.add(rid, ids, **params)
        runs.append(client.run(arrivals))
    plain, overlapped = runs
    assert overlapped.tokens == plain.tokens
    assert overlapped.finish == plain.finish
    assert plain.in_flight_steps == 0
    return plain, overlapped


def greedy(n: int, **more) -> dict:
    return dict(temperature=0, max_new_tokens=n, **more)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_overlapped_steps_give_the_plain_order_s_tokens_and_logprobs(tiny_models, arch):
    # Different lengths: requests finish at different steps, each one computed once more after its end.
    requests = [(str(i), ids, greedy(6 + 3 * i, min_new_tokens=6 + 3 * i, return_logprob=True, top_logprobs_num=2))
                for i, ids in enumerate(PROMPTS)]
    plain, overlapped = both(tiny_models[arch], requests)
    assert overlapped.in_flight_steps > 10
    assert [len(plain.tokens[(str(i), 0)]) for i in range(len(PROMPTS))] == [6 + 3 * i for i in range(len(PROMPTS))]


def test_arrivals_stop_tokens_choices_and_seeded_sampling_come_out_the_same(tiny_models):
    model = tiny_models["llama"]
    first = Client(engine_for(model, "off")).run({0: [("probe", PROMPTS[0], greedy(8))]})
    probe = [t for t, _ in first.tokens[("probe", 0)]]
    stop_at = probe[4]  # a token the prompt's greedy output reaches by its 5th step
    requests = [("stop", PROMPTS[0], greedy(8, stop_token_ids=[stop_at])),
                ("n", PROMPTS[1], dict(temperature=0.9, top_p=0.8, n=3, seed=11, max_new_tokens=9)),
                ("seeded", PROMPTS[2], dict(temperature=1.0, top_k=20, seed=5, max_new_tokens=12, min_new_tokens=12))]
    arrivals = {3: [("late", PROMPTS[3], greedy(7))], 6: [("later", PROMPTS[4], dict(temperature=0.7, seed=3,
                                                                                     max_new_tokens=10))]}
    plain, overlapped = both(model, requests, arrivals)
    assert plain.finish[("stop", 0)] == "stop" and plain.tokens[("stop", 0)][-1][0] == stop_at
    assert len(plain.tokens[("stop", 0)]) == probe.index(stop_at) + 1
    assert {k for k in plain.tokens if k[0] == "n"} == {("n", 0), ("n", 1), ("n", 2)}
    assert overlapped.in_flight_steps > 5


def test_retraction_when_pages_run_out_loses_nothing(tiny_models):
    # 12 pages of 4 tokens for four requests growing to ~30 tokens each: running ones are retracted, recomputed.
    requests = [(str(i), ids, greedy(18, min_new_tokens=18)) for i, ids in enumerate(PROMPTS[:4])]
    plain, overlapped = both(tiny_models["llama"], requests, pages=12)
    assert all(len(v) == 18 for v in plain.tokens.values())


def test_a_computed_prompt_decodes_in_the_next_step_from_its_placeholder(tiny_models):
    client = Client(engine_for(tiny_models["llama"], "on"))
    client.add("a", PROMPTS[0], **greedy(5))
    client.step()  # the prompt's step: its first token is sampled and left on the device
    engine = client.engine
    assert engine.overlap.pending is not None and [r.output_ids for r in engine.scheduler.running] == [[-1]]
    assert ("a", 0) not in client.tokens
    client.step()  # decodes from the placeholder; the first token is read and goes out meanwhile
    assert len(client.tokens[("a", 0)]) == 1 and len(engine.scheduler.running[0].output_ids) == 2


def test_requests_that_read_their_tokens_on_the_host_are_not_overlapped(tiny_models):
    requests = [("pen", PROMPTS[0], greedy(8, repetition_penalty=1.3, frequency_penalty=0.5)),
                ("plain", PROMPTS[1], greedy(8))]
    _, overlapped = both(tiny_models["llama"], requests)
    assert overlapped.in_flight_steps == 0  # one penalised row keeps every step of its batch read at once


def test_an_abort_while_a_step_is_in_flight_reads_it_first(tiny_models):
    client = Client(engine_for(tiny_models["llama"], "on"))
    client.add("a", PROMPTS[0], **greedy(30))
    client.add("b", PROMPTS[1], **greedy(30))
    for _ in range(6):
        client.step()
    assert client.engine.overlap.pending is not None
    in_flight = len(client.tokens[("a", 0)])
    client.engine.abort("a")
    assert client.finish[("a", 0)] == "abort"
    assert len(client.tokens[("a", 0)]) == in_flight + 1  # the in-flight token went out before the abort
    client.run()
    assert len(client.tokens[("b", 0)]) == 30 and client.finish[("b", 0)] == "length"
    plain = Client(engine_for(tiny_models["llama"], "off"))
    plain.add("b", PROMPTS[1], **greedy(30))
    assert plain.run().tokens[("b", 0)] == client.tokens[("b", 0)]


def test_overlap_on_the_static_decode_buffers_as_on_a_gpu(tiny_models):
    requests = [(str(i), ids, greedy(5 + 2 * i, return_logprob=True)) for i, ids in enumerate(PROMPTS)]
    _, overlapped = both(tiny_models["llama"], requests, decode_graphs="static", cuda_graph_bs=(1, 4, 8))
    assert overlapped.in_flight_steps > 5


def test_the_cpu_default_reads_every_step_at_once_and_speculation_turns_it_off(tiny_models):
    from pdserve.shared.config import SpeculativeConfig

    assert not engine_for(tiny_models["llama"], "auto").overlap.enabled  # on a CPU it would only delay each token
    assert not engine_for(tiny_models["llama"], "on", speculative=SpeculativeConfig()).overlap.enabled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
def test_on_cuda_an_overlapped_step_never_waits_for_the_device(tiny_models):
    # All requests end at the same step, so the overlapped run's batches are the plain run's, row for row.
    requests = [("greedy", PROMPTS[0], greedy(16, min_new_tokens=16, return_logprob=True, top_logprobs_num=3)),
                ("sampled", PROMPTS[1], dict(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_new_tokens=16,
                                             min_new_tokens=16)),
                ("plain", PROMPTS[2], dict(temperature=1.0, seed=8, max_new_tokens=16, min_new_tokens=16))]
    runs = {}
    for overlap in ("off", "auto"):
        engine = Engine(RuntimeConfig(model_path=str(tiny_models["llama"]), dtype="float32", device="cuda",
                                      overlap_schedule=overlap, cuda_graph_bs=(1, 4, 8),
                                      cache=CacheConfig(page_size=4, max_total_tokens=4 * 96)))
        assert engine.overlap.enabled == (overlap == "auto") and engine.runner.graphs.graphs
        client = Client(engine)
        for rid, ids, params in requests:
            client.add(rid, ids, **params)
        while not engine.scheduler.running or len(engine.scheduler.running[0].output_ids) < 4:
            client.step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises
        try:
            for _ in range(6):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs[overlap] = client.run()
    assert runs["auto"].tokens.keys() == runs["off"].tokens.keys()
    for key, got in runs["auto"].tokens.items():
        want = runs["off"].tokens[key]
        assert [t for t, _ in got] == [t for t, _ in want], key
    assert runs["auto"].in_flight_steps > 0
