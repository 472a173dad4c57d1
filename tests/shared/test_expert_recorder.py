"""Expert-distribution recording in the engine: per layer and expert, the routing choices transformers makes for
the same tokens; SGLang's start / stop / dump semantics; its stat file format; refused on a dense model."""
from __future__ import annotations

import re

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.expert_recorder import ExpertRecorder, save_dump
from pdserve.shared.models.moe import SparseMoE
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 23, 42, 7, 300, 11], [1, 77, 3, 150, 8]]
NEW_TOKENS = 6


def make_engine(model_dir) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32",
                                cache=CacheConfig(page_size=4, max_total_tokens=4 * 64)))


def generate(engine: Engine, prompts=PROMPTS) -> list[list[int]]:
    """Greedy tokens of each prompt, from an empty prefix cache (so every prompt token runs the forward)."""
    engine.flush_cache()
    outputs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(Req(rid=str(i), input_ids=list(ids),
                               on_output=lambda out: outputs.setdefault(out.rid, []).extend(out.token_ids),
                               params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS,
                                                     min_new_tokens=NEW_TOKENS)))
    while engine.has_work():
        engine.step()
    return [outputs[str(i)] for i in range(len(prompts))]


def route_hooks(engine: Engine) -> set:
    return {layer.mlp.on_route for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoE)}


@pytest.mark.parametrize("arch", ["qwen2-moe", "qwen3-moe"])  # qwen3-moe: a dense layer between two expert ones
def test_counts_are_the_routing_choices_of_every_forward_token(tiny_models, arch):
    from transformers import AutoModelForCausalLM

    engine = make_engine(tiny_models[arch])
    moe, num_layers = engine.model_config.moe, engine.model_config.num_layers
    engine.experts.start()
    (record,) = route_hooks(engine)
    seen = torch.zeros(num_layers, moe.num_experts, dtype=torch.int64)

    def spy(layer_id: int, topk_ids: torch.Tensor) -> None:  # counts by hand what the recorder is handed
        seen[layer_id] += torch.bincount(topk_ids.flatten(), minlength=moe.num_experts)
        record(layer_id, topk_ids)

    engine.runner.model.set_route_hook(spy)
    outputs = generate(engine)
    engine.experts.stop()
    counts = engine.experts.dump()

    assert counts.dtype == torch.int64 and counts.shape == (num_layers, moe.num_experts)
    assert torch.equal(counts, seen)
    # Each prompt token runs once, and each generated token but the last; k choices in every expert layer.
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NEW_TOKENS - 1)
    assert counts.sum().item() == tokens * moe.top_k * len(moe.sparse_layers)
    dense = [i for i in range(num_layers) if i not in moe.sparse_layers]
    assert all(counts[i].sum() == 0 for i in dense)
    # transformers routes each whole sequence in one forward: the same choices, counted directly.
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    expected = torch.zeros_like(counts)
    for prompt, out in zip(PROMPTS, outputs):
        with torch.no_grad():
            router = hf(torch.tensor([prompt + out[:-1]]), output_router_logits=True).router_logits
        for layer, logits in zip(moe.sparse_layers, router):  # [T, E] per expert layer
            chosen = logits.topk(moe.top_k, dim=-1).indices.flatten()
            expected[layer] += torch.bincount(chosen, minlength=moe.num_experts)
    assert torch.equal(counts, expected)


def test_start_stop_dump_follow_sglang(tiny_models):
    engine = make_engine(tiny_models["qwen2-moe"])
    assert route_hooks(engine) == {None}  # not recording costs nothing: no hook at all
    engine.experts.start()
    generate(engine)
    once = engine.experts.dump()  # while recording: the counts so far, and recording goes on from zero
    assert once.sum() > 0
    assert engine.experts.dump().sum() == 0
    generate(engine)
    engine.experts.stop()
    assert route_hooks(engine) == {None}
    generate(engine)  # not counted
    assert torch.equal(engine.experts.dump(), once)  # the same greedy run routes the same way
    engine.experts.start()
    generate(engine)
    engine.experts.start()  # a start clears what was counted
    assert engine.experts.dump().sum() == 0
    engine.experts.stop()


def test_dense_model_has_no_experts_to_record(tiny_models):
    engine = make_engine(tiny_models["llama"])
    for command in (engine.experts.start, engine.experts.stop, engine.experts.dump):
        with pytest.raises(ValueError, match="has no experts"):
            command()


def test_dump_file_is_sglang_stat_format(tmp_path):
    recorder = ExpertRecorder(3, 4)
    recorder.start()
    recorder.record(0, torch.tensor([[0, 1], [1, 3]]))
    recorder.record(2, torch.tensor([[2, 3]]))
    counts = recorder.dump()
    assert counts.tolist() == [[1, 2, 0, 1], [0, 0, 0, 0], [0, 0, 1, 1]]
    path = save_dump(counts, tmp_path / "new-dir", tag="decode-50052")
    assert re.fullmatch(r"expert_distribution_recorder_\d+(\.\d+)?_decode-50052\.pt", path.name)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing half-written left beside it
    data = torch.load(path)
    assert set(data) == {"rank", "logical_count", "average_utilization_rate_over_window"}
    assert data["rank"] == 0 and data["average_utilization_rate_over_window"] is None
    assert data["logical_count"].shape == (1, 3, 4) and torch.equal(data["logical_count"][0], counts)
    assert re.fullmatch(r"expert_distribution_recorder_\d+(\.\d+)?\.pt", save_dump(counts, tmp_path).name)
