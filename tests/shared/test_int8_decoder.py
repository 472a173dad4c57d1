"""`--quantization w8a8_int8` on decoder models: the dense layers' matmuls in int8, close to the unquantized
model's logits on every architecture, the same answers on the default model, batch-invariant, half the weight
bytes, and kept across a live weight update."""
from __future__ import annotations

import pytest
import torch
from fixtures import ARCHS

from pdserve.shared.config import CacheConfig, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.int8_linear import Int8Linear
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.models.moe import DenseMLP
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch
from pdserve.shared.weights import read_checkpoint

PROMPT = [5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66, 12, 130, 4]


def prefill_logits(model_dir, quantization: str | None, dtype: str = "float32") -> torch.Tensor:
    runner = ModelRunner(RuntimeConfig(model_path=str(model_dir), dtype=dtype, quantization=quantization,
                                       cache=CacheConfig(page_size=4, max_total_tokens=256)))
    req = Req(rid="0", input_ids=list(PROMPT), params=SamplingParams(temperature=0))
    req.pages = PageAllocator(runner.pool.num_pages).allocate(4)
    return runner.forward(Batch([req], is_decode=False, extend_lens=[len(PROMPT)])).float()[0]


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama3-rope"])
def test_quantized_logits_stay_close_to_the_unquantized_ones(tiny_models, arch):
    """Every family (Qwen2's q/k/v bias, Qwen3's head norms, MoE blocks whose experts stay unquantized): int8
    moves the logits by about a percent, never to another model."""
    plain = prefill_logits(tiny_models[arch], None)
    int8 = prefill_logits(tiny_models[arch], "w8a8_int8")
    assert not torch.equal(int8, plain)  # the quantized layers did run
    cosine = torch.nn.functional.cosine_similarity(int8, plain, dim=0).item()
    assert cosine > 0.995, cosine
    assert (int8 - plain).abs().max() < 0.1 * plain.abs().max()


@pytest.fixture(scope="module")
def int8_engine(default_model_dir) -> Engine:
    return Engine(RuntimeConfig(model_path=str(default_model_dir), quantization="w8a8_int8", deterministic=True,
                                cache=CacheConfig(page_size=16, max_total_tokens=16 * 128)))


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int = 24) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(Req(rid=str(i), input_ids=ids, on_output=lambda o: out.setdefault(o.rid, []).extend(
            o.token_ids), params=SamplingParams(temperature=0, max_new_tokens=new_tokens)))
    while engine.has_work():
        engine.step()
    engine.flush_cache()
    return [out[str(i)] for i in range(len(prompts))]


def test_default_model_quantized_answers_and_weighs_half(int8_engine, chat, tokenizer):
    model = int8_engine.runner.model
    layers = [lin for layer in model.layers for lin in layer.linears()] + [model.lm_head]
    assert all(isinstance(lin, Int8Linear) for lin in layers)
    int8_bytes = sum(lin.nbytes for lin in layers)
    dense_bytes = sum(lin.shape.numel() * model.dtype.itemsize for lin in layers)
    assert int8_bytes < 0.55 * dense_bytes
    answer = tokenizer.decode(greedy(int8_engine, [chat("What is the capital of France?")])[0])
    assert "Paris" in answer


def test_quantized_greedy_output_does_not_depend_on_the_batch(int8_engine, chat):
    """With --enable-deterministic-inference a quantized model keeps its promise: a prompt's tokens alone and
    among others are the same (each row is quantized and summed on its own)."""
    prompts = [chat(q) for q in ("Name a color.", "Write a haiku about rain.", "What is 7 times 8?",
                                 "Tell me about the moon in three sentences.")]
    together = greedy(int8_engine, prompts)
    for ids, tokens in zip(prompts[:2], together[:2]):
        assert greedy(int8_engine, [ids]) == [tokens]


def test_a_weight_update_stays_quantized(tiny_models):
    runner = ModelRunner(RuntimeConfig(model_path=str(tiny_models["llama"]), dtype="float32",
                                       quantization="w8a8_int8", cache=CacheConfig(page_size=4, max_total_tokens=64)))
    model = runner.model
    staged = runner.build_weights(read_checkpoint(str(tiny_models["llama"]), runner.model_config,
                                                  model.checkpoint_shapes))
    assert isinstance(staged.layers[0].qkv, Int8Linear)
    assert isinstance(staged.layers[0].mlp, DenseMLP) and isinstance(staged.layers[0].mlp.down, Int8Linear)
