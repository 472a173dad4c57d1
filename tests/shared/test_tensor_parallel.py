"""Tensor parallelism in the runtime: a model split over ranks (real processes meeting in shared memory) gives
what the whole model gives, and a split the model's shapes cannot take is refused with the numbers.

Rank 0 runs in this process and leads; the other ranks are the follower processes it starts (`Ranks`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time

import pytest
import torch

from fixtures import make_tiny_model

from pdserve.shared.config import (CacheConfig, LoraConfig, ModelConfig, Role, RuntimeConfig, SpeculativeConfig,
                                   TierConfig)
from pdserve.shared.engine import Engine
from pdserve.shared.kv_keys import chain_keys
from pdserve.shared.model_runner import ModelRunner, _check_tp_features
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch
from pdserve.shared.tp_ranks import Launch, Ranks, cpu_sets
from pdserve.shared.tp_group import RankGone
from pdserve.shared.tp_shards import Shards, check_tp_size

PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66], [1, 2, 3], [400, 401, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
CORES = len(os.sched_getaffinity(0))


def config(model_dir, dtype: str = "float32", **kw) -> RuntimeConfig:
    return RuntimeConfig(model_path=str(model_dir), dtype=dtype, kernels="native",
                         cache=CacheConfig(page_size=4, max_total_tokens=4 * 128), **kw)


class Split:
    """A tensor-parallel runner: rank 0 here, the others in their own processes; closed on exit."""

    def __init__(self, cfg: RuntimeConfig, size: int, timeout_s: float = 10.0, collectives: str = "shm") -> None:
        # More ranks than cores share them (correctness only): rank r on core r % cores.
        cpus = cpu_sets(size, None) if size <= CORES else [{r % CORES} for r in range(size)]
        affinity = os.sched_getaffinity(0)
        threads = torch.get_num_threads()
        self.ranks = Ranks(cfg, Launch(size, cpus, timeout_s, collectives=collectives))
        try:
            mc = ModelConfig.from_dir(cfg.model_path)
            self.runner = ModelRunner(cfg, mc, tp=self.ranks.rank0(mc))
        except BaseException:
            self.ranks.close(0)
            raise
        finally:  # rank 0 pinned this process to its cores; the rest of the suite wants them all back
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)

    def __enter__(self) -> ModelRunner:
        return self.runner

    def __exit__(self, *exc) -> None:
        self.runner.close()
        self.ranks.close()


def steps(runner: ModelRunner, decode_steps: int = 3) -> torch.Tensor:
    """Logits [1 + decode_steps, B, V] of a prefill of PROMPTS (the last in two chunks) and decode steps."""
    alloc = PageAllocator(runner.pool.num_pages)
    reqs = []
    for i, ids in enumerate(PROMPTS):
        req = Req(rid=str(i), input_ids=list(ids), params=SamplingParams(temperature=0))
        req.pages = alloc.allocate(-(-(len(ids) + decode_steps) // runner.page_size))[::-1]
        reqs.append(req)
    split = 6
    lens = [len(r.input_ids) for r in reqs[:-1]] + [split]
    first = runner.forward(Batch(reqs, is_decode=False, extend_lens=lens)).clone()
    for r, n in zip(reqs, lens):
        r.num_computed = n
    last = reqs[-1]
    first[-1] = runner.forward(Batch([last], is_decode=False, extend_lens=[len(last.input_ids) - split]))[0]
    last.num_computed = len(last.input_ids)
    out = [first]
    for step in range(decode_steps):
        for req in reqs:
            req.output_ids.append(100 + step + int(req.rid))
        out.append(runner.forward(Batch(reqs, is_decode=True, extend_lens=[1] * len(reqs))))
        for req in reqs:
            req.num_computed += 1
    return torch.stack(out)


@functools.lru_cache(maxsize=None)
def whole(model_dir: str, dtype: str = "float32") -> torch.Tensor:
    return steps(ModelRunner(config(model_dir, dtype)))


# ------------------------------------------------------------------------------------------------ the split
def test_the_default_models_three_kv_groups_split_two_and_one(default_model_dir):
    mc = ModelConfig.from_dir(str(default_model_dir))
    a, b = (Shards.plan(mc, r, 2) for r in range(2))
    assert (a.kv_heads, b.kv_heads) == ((0, 2), (2, 3))
    assert (a.heads, b.heads) == ((0, 6), (6, 9))  # whole groups of 3 query heads
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 1536))
    assert (a.vocab, b.vocab) == ((0, 24576), (24576, 49152))


def test_fewer_kv_heads_than_ranks_replicate_them(tiny_models):
    mc = ModelConfig.from_dir(str(tiny_models["llama"]))  # 4 query heads, 2 KV heads
    plans = [Shards.plan(mc, r, 4) for r in range(4)]
    assert [p.heads for p in plans] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_a_split_the_shapes_cannot_take_is_refused_with_the_numbers(tiny_models):
    mc = ModelConfig.from_dir(str(tiny_models["llama"]))
    with pytest.raises(ValueError, match=r"--tp-size 3 .* 4 query heads in 2 KV-head groups"):
        check_tp_size(mc, 3)
    with pytest.raises(ValueError, match="needs a core per rank"):
        cpu_sets(CORES + 1, None)
    with pytest.raises(ValueError, match="names 1 core sets for --tp-size 2"):
        cpu_sets(2, "0")


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2-moe", "mixtral"])
def test_two_ranks_give_the_logits_of_the_whole_model(tiny_models, arch):
    """fp32: within 1e-4 of one process, prefill (chunked too) and decode, on every family's shapes (tied and
    untied heads, Qwen2's qkv bias, Qwen3's head norms and head_dim, experts with and without a shared one)."""
    with Split(config(tiny_models[arch]), 2) as runner:
        got = steps(runner)
    torch.testing.assert_close(got, whole(str(tiny_models[arch])), atol=1e-4, rtol=0)


def test_four_ranks_over_two_kv_heads(tiny_models):
    with Split(config(tiny_models["qwen2"]), 4) as runner:
        got = steps(runner)
    torch.testing.assert_close(got, whole(str(tiny_models["qwen2"])), atol=1e-4, rtol=0)


def generate(runner: ModelRunner, prompts: list[list[int]], max_new: int,
             adapters: list[str | None] | None = None, spec: dict | None = None) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs of each prompt (with adapters[i], when given), through the engine, all
    prompts batched together."""
    engine = Engine(runner.config, Role.COLOCATED, runner)
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}

    def collect(out):
        tokens.setdefault(out.rid, []).extend(out.token_ids)
        lps.setdefault(out.rid, []).extend(lp.logprob for lp in out.logprobs)

    for i, ids in enumerate(prompts):
        engine.add_request(Req(rid=str(i), input_ids=ids, on_output=collect, params=SamplingParams(
            temperature=0, max_new_tokens=max_new, min_new_tokens=max_new, return_logprob=True)),
            lora=adapters[i] if adapters else None)
    while engine.has_work():
        engine.step()
    if spec is not None:  # what speculative decoding drafted and got accepted
        spec["accepted_tokens"] = engine.speculator.accepted_tokens
    return [(tokens[str(i)], lps[str(i)]) for i in range(len(prompts))]


def test_the_default_model_split_two_and_one_answers_as_one_process(default_model_dir, chat):
    """The real model in fp32, its 3 KV-head groups over 2 ranks: the same greedy tokens, logprobs within 1e-4."""
    prompts = [chat("What is the capital of France?"), chat("Write a haiku about the sea."), chat("2+2=")]
    cfg = config(default_model_dir)
    alone = generate(ModelRunner(cfg), prompts, 24)
    with Split(cfg, 2) as runner:
        split = generate(runner, prompts, 24)
    for (ids_a, lps_a), (ids_b, lps_b) in zip(alone, split):
        assert ids_b == ids_a
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


# ------------------------------------------------------------------------------------------------ faults
def test_a_rank_killed_mid_serving_stops_rank_0_at_once(tiny_models):
    with Split(config(tiny_models["llama"]), 2, timeout_s=30.0) as runner:
        steps(runner, 1)
        follower = runner.tp.box.pids()[1]
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(RankGone, match="rank 1 .* is gone"):
            for _ in range(100):  # the next step's first all-reduce notices: well before the 30 s timeout
                steps(runner, 1)


def test_a_rank_that_hangs_stops_rank_0_after_the_timeout(tiny_models):
    with Split(config(tiny_models["llama"]), 2, timeout_s=1.5) as runner:
        steps(runner, 1)
        follower = runner.tp.box.pids()[1]
        os.kill(follower, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RankGone, match="no answer from the other ranks for 1.5 s"):
                steps(runner, 1)
            assert time.monotonic() - started < 5
        finally:
            os.kill(follower, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ weights
def test_every_rank_updates_to_its_shards_of_new_weights(tiny_models, tmp_path):
    other = make_tiny_model("llama", tmp_path / "other", seed=1)
    with Split(config(tiny_models["llama"]), 2) as runner:
        staged = runner.build_weights(runner.read_weights(str(other)))
        torch.testing.assert_close(steps(runner), whole(str(tiny_models["llama"])), atol=1e-4, rtol=0)  # not yet
        runner.swap_weights(staged)
        torch.testing.assert_close(steps(runner), whole(str(other)), atol=1e-4, rtol=0)
        runner.build_weights(runner.read_weights(str(tiny_models["llama"])))
        runner.discard_weights()  # staged, then dropped: the ranks still serve `other`, and still step together
        torch.testing.assert_close(steps(runner), whole(str(other)), atol=1e-4, rtol=0)


def test_torch_distributed_collectives_give_the_same_logits(tiny_models):
    """The path GPUs take (torch.distributed, the step's tensors broadcast through the group), here over gloo."""
    with Split(config(tiny_models["qwen2"]), 2, collectives="torch") as runner:
        got = steps(runner)
    torch.testing.assert_close(got, whole(str(tiny_models["qwen2"])), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------ what requests carry
def test_int8_under_two_ranks_stays_as_close_to_the_model_as_one_process(tiny_models):
    """w8a8_int8 quantizes each rank's slice (a row-parallel layer's activations per rank): the logits stay
    within int8's own distance of the unquantized model."""
    plain = whole(str(tiny_models["qwen2"]))
    with Split(config(tiny_models["qwen2"], quantization="w8a8_int8"), 2) as runner:
        int8 = steps(runner)
    assert not torch.equal(int8, plain)
    cosine = torch.nn.functional.cosine_similarity(int8.flatten(), plain.flatten(), dim=0).item()
    assert cosine > 0.995, cosine


def test_speculative_decoding_under_two_ranks_gives_the_greedy_tokens(tiny_models):
    """n-gram drafts verified by a forward of every rank: the tokens of plain greedy decoding in one process."""
    repetitive = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 40, 41, 42, 40, 41]]
    cfg = config(tiny_models["llama"])
    plain = generate(ModelRunner(cfg), repetitive, 20)
    spec: dict = {}
    with Split(config(tiny_models["llama"], speculative=SpeculativeConfig(num_draft_tokens=4)), 2) as runner:
        drafted = generate(runner, repetitive, 20, spec=spec)
    assert [ids for ids, _ in drafted] == [ids for ids, _ in plain]
    assert spec["accepted_tokens"] > 0  # drafts were verified by the split model, and some kept


def test_lora_adapters_sharded_as_their_layers_answer_as_one_process(default_model_dir, default_model_adapters, chat):
    """Three adapters (attention only; every module, rsLoRA; v, up and down) and the base model in one batch, on
    the default model's uneven 2 + 1 split, against the same in one process; two slots, so adapters also move in
    and out of slots on every rank as the batch goes."""
    names = list(default_model_adapters)
    lora = LoraConfig(paths=tuple((n, str(p)) for n, p in default_model_adapters.items()), max_loras_per_batch=2)
    prompts = [chat("Write a SQL query."), chat("Write a poem."), chat("Say yes."), chat("Hello")]
    adapters = names + [None]
    cfg = config(default_model_dir, lora=lora)
    alone = generate(ModelRunner(cfg), prompts, 8, adapters)
    with Split(cfg, 2) as runner:
        split = generate(runner, prompts, 8, adapters)
    for (ids_a, lps_a), (ids_b, lps_b) in zip(alone, split):
        assert ids_b == ids_a
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


# ------------------------------------------------------------------------------------------------ the storage tier
def run_prompts(engine: Engine, prompts: dict[str, list[int]], reqs: dict[str, Req] | None = None) -> dict:
    """{rid: greedy tokens}, one prompt at a time, the engine stepped as its loop would (the tier polled)."""
    out: dict[str, list[int]] = {}
    for rid, ids in prompts.items():
        req = (reqs or {}).get(rid) or Req(rid=rid, input_ids=list(ids), params=SamplingParams(
            temperature=0, max_new_tokens=8))
        req.on_output = lambda o: out.setdefault(o.rid, []).extend(o.token_ids)
        engine.add_request(req)
        end = time.monotonic() + 120
        while engine.has_work() or (engine.tiers is not None and engine.tiers.held_reqs()):
            assert time.monotonic() < end, "the engine did not finish"
            if engine.tiers is not None:
                engine.tiers.poll()
            engine.step() if engine.has_work() else time.sleep(0.001)
        while engine.tiers is not None and engine.tiers.writing:  # its pages written before the next prompt
            engine.tiers.poll()
            time.sleep(0.002)
    return out


def test_two_ranks_store_and_read_back_their_own_kv_heads_of_a_long_prompt(tmp_path):
    """fp32, 2 KV heads over 2 ranks, the storage tier: a 1,100-token prompt pushed out of a 2,048-token pool by two
    others as long comes back from storage (each rank reads its own heads, under its own keys) and answers as one
    process computing it cold; a worker started on the directory reads all of it; a page one rank lost is
    computed again by both."""
    model = make_tiny_model("llama", tmp_path / "model", max_position_embeddings=2048)
    long = [(i * 37 + 11) % 500 + 1 for i in range(1100)]
    others = {f"b{k}": [(k * 13 + i * 7) % 480 + 20 for i in range(1100)] for k in range(2)}
    plain = dataclasses.replace(config(model), cache=CacheConfig(page_size=16, max_total_tokens=2048))
    cold = run_prompts(Engine(plain, Role.COLOCATED, ModelRunner(plain)), {"a": long})["a"]
    tiered = dataclasses.replace(plain, tiers=TierConfig(str(tmp_path / "kv"), prefetch_policy="wait_complete"))
    with Split(tiered, 2) as runner:
        engine = Engine(tiered, Role.COLOCATED, runner)
        assert run_prompts(engine, {"a": long, **others})["a"] == cold
        again = Req(rid="a2", input_ids=list(long), params=SamplingParams(temperature=0, max_new_tokens=8))
        assert run_prompts(engine, {"a2": long}, {"a2": again})["a2"] == cold
        assert again.tier_tokens == {"storage": 1088}  # every full page: none was left in the pool
    parts = {p.parent.parent.name for p in (tmp_path / "kv").rglob("*.kv")}
    assert len(parts) == 2  # an identity of each rank's, each with its own page files
    with Split(tiered, 2) as runner:  # a fresh worker, its pool empty
        engine = Engine(tiered, Role.COLOCATED, runner)
        first = Req(rid="a", input_ids=list(long), params=SamplingParams(temperature=0, max_new_tokens=8))
        assert run_prompts(engine, {"a": long}, {"a": first})["a"] == cold and first.tier_tokens == {"storage": 1088}
        assert engine.flush_cache(lower=())  # the pool only: the files stay
        # rank 1's part of page 40 gone: from there on both ranks compute, though rank 0 has its parts
        key = chain_keys(engine.tiers.root_key, engine.cache.page_keys(long, 68, None))[40]
        rank1, = {p.parent.parent.name for p in (tmp_path / "kv").rglob("*.kv")} - {engine.tiers.root_key}
        part = chain_keys(rank1, [(key,)])[0]
        (tmp_path / "kv" / rank1 / part[:2] / f"{part}.kv").unlink()
        third = Req(rid="a3", input_ids=list(long), params=SamplingParams(temperature=0, max_new_tokens=8))
        assert run_prompts(engine, {"a3": long}, {"a3": third})["a3"] == cold
        assert third.tier_tokens == {"storage": 40 * 16}


def test_the_host_tier_under_two_ranks_is_refused_naming_why(tiny_models):
    tiered = dataclasses.replace(config(tiny_models["llama"]), tiers=TierConfig(host_ratio=2.0))
    with pytest.raises(ValueError, match=r"--hicache-ratio / --hicache-size \(the host tier keeps rank 0's KV heads"):
        _check_tp_features(tiered)
    _check_tp_features(dataclasses.replace(tiered, tiers=TierConfig("/tmp/kv")))  # storage alone: taken
