"""Decode steps on static, bucketed buffers (the path CUDA graphs capture), run on the CPU without capture.

The padded path must give what the dynamic path gives: the same greedy tokens and the same logprobs, for
batches that fill a bucket and batches padded up to one, while padding rows never touch a request's KV.
"""
from __future__ import annotations

import logging

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.decode_graphs import bucket_sizes
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66], [1, 2, 3], [400, 401, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           [7, 7, 7, 7, 7], [30, 31], [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106]]


def test_default_buckets_cover_every_size_up_to_the_largest():
    sizes = bucket_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-1] == 256 and list(sizes) == sorted(set(sizes))
    assert 64 in sizes and 128 in sizes and 160 in sizes
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_sizes(8, (4, 1, 4, 8)) == (1, 4, 8)
    with pytest.raises(ValueError, match="cuda-graph-bs"):
        bucket_sizes(8, (0, 2))


def engine_for(model_dir, graphs: str, **config) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32", decode_graphs=graphs,
                                cache=CacheConfig(page_size=4, max_total_tokens=4 * 96),
                                scheduler=SchedulerConfig(max_prefill_tokens=64), **config))


def generate(engine: Engine, prompts: list[list[int]], new_tokens: int = 12) -> dict:
    outputs: dict[str, list] = {}

    def collect(out):
        outputs.setdefault(out.rid, []).extend((t, lp.logprob) for t, lp in zip(out.token_ids, out.logprobs))

    for i, ids in enumerate(prompts):
        # Different lengths: the batch shrinks as requests finish, so it is padded to several buckets in turn.
        n = new_tokens + 3 * i
        engine.add_request(Req(rid=str(i), input_ids=list(ids), on_output=collect,
                               params=SamplingParams(temperature=0, max_new_tokens=n, min_new_tokens=n,
                                                     return_logprob=True)))
    while engine.has_work():
        engine.step()
    assert engine.scheduler.check_integrity().ok
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_buffers_give_the_tokens_and_logprobs_of_the_dynamic_path(tiny_models, arch):
    dynamic = generate(engine_for(tiny_models[arch], "off"), PROMPTS)
    engine = engine_for(tiny_models[arch], "static", cuda_graph_bs=(1, 4, 8))  # 6, 5, 3 and 2 rows get padded
    static = generate(engine, PROMPTS)
    assert static.keys() == dynamic.keys()
    for rid in dynamic:
        assert [t for t, _ in static[rid]] == [t for t, _ in dynamic[rid]]
        assert torch.allclose(torch.tensor([lp for _, lp in static[rid]]),
                              torch.tensor([lp for _, lp in dynamic[rid]]), atol=1e-5)
    runner = engine.runner
    assert runner.pool.scratch_page == runner.pool.num_pages  # the page beyond the scheduler's
    assert engine.allocator.num_pages == runner.pool.num_pages


def test_batches_above_the_largest_bucket_run_the_dynamic_way_said_once(tiny_models, caplog):
    expected = generate(engine_for(tiny_models["llama"], "off"), PROMPTS[:4], new_tokens=4)
    engine = engine_for(tiny_models["llama"], "static", cuda_graph_bs=(1, 2))
    graphs, sizes = engine.runner.graphs, []
    run = graphs.run
    graphs.run = lambda fb: sizes.append(fb.seq_lens.shape[0]) or run(fb)
    with caplog.at_level(logging.INFO, logger="pdserve.shared.decode_graphs"):
        got = generate(engine, PROMPTS[:4], new_tokens=4)
    assert {rid: [t for t, _ in v] for rid, v in got.items()} == {rid: [t for t, _ in v] for rid, v in expected.items()}
    assert sizes and max(sizes) == 2  # the steps of 3 and 4 sequences went the dynamic way
    told = [r.getMessage() for r in caplog.records if "without graphs" in r.getMessage()]
    assert told == ["decode steps run without graphs for batches above 2 sequences (--cuda-graph-max-bs)"]


def test_adapter_rows_and_expert_models_run_the_dynamic_way(tiny_models):
    engine = engine_for(tiny_models["llama"], "static")
    engine.add_request(Req(rid="a", input_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_new_tokens=3)))
    engine.step()  # its prompt
    req = engine.scheduler.running[0]
    fb = engine.runner.prepare(engine.scheduler.schedule_decode())
    assert engine.runner.graphs.why_not(fb) is None
    req.lora_slot = 0
    fb = engine.runner.prepare(engine.scheduler.schedule_decode())
    assert engine.runner.graphs.why_not(fb) == "LoRA adapters in the batch"
    assert engine_for(tiny_models["qwen2-moe"], "static").runner.graphs.skip_all == "expert layers"


def test_off_by_default_on_the_cpu(tiny_models):
    engine = Engine(RuntimeConfig(model_path=str(tiny_models["llama"]), dtype="float32",
                                  cache=CacheConfig(page_size=4, max_total_tokens=4 * 96)))
    assert engine.runner.graphs is None and engine.runner.pool.scratch_page is None
