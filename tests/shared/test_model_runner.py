"""The runtime's forward pass against transformers, on tiny random checkpoints of each architecture."""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch

# Triton runs on CUDA, or on CPU only through the interpreter (used when there is no GPU); the native set is
# the CPU's C++ kernels.
CUDA = torch.cuda.is_available()
BACKENDS = [("cpu", "native"), ("cpu", "torch")] + ([("cuda", "torch"), ("cuda", "triton")] if CUDA
                                                    else [("cpu", "triton")])
PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66], [1, 2, 3], [400, 401, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [len, V]


def make_runner(model_dir, backend: str, device: str = "cpu", page_size: int = 4) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model_path=str(model_dir), dtype="float32", attention_backend=backend,
                                     device=device,
                                     cache=CacheConfig(page_size=page_size, max_total_tokens=page_size * 64)))


def make_reqs(runner: ModelRunner, prompts: list[list[int]]) -> list[Req]:
    alloc = PageAllocator(runner.pool.num_pages)
    reqs = []
    for i, ids in enumerate(prompts):
        req = Req(rid=str(i), input_ids=list(ids), params=SamplingParams(temperature=0))
        # Shuffle page order so the test cannot pass by accident of contiguous pages.
        req.pages = alloc.allocate(-(-(len(ids) + 4) // runner.page_size))[::-1]
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3-rope"])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_prefill_then_decode_logits_match_transformers(tiny_models, arch, backend, device):
    runner = make_runner(tiny_models[arch], backend, device)
    reqs = make_reqs(runner, PROMPTS)
    # Prefill all prompts in one batch; the last one in two chunks to exercise a cached prefix.
    split = 6
    lens = [len(r.input_ids) for r in reqs[:-1]] + [split]
    logits = runner.forward(Batch(reqs, is_decode=False, extend_lens=lens))
    for r, n in zip(reqs, lens):
        r.num_computed = n
    last = reqs[-1]
    tail = runner.forward(Batch([last], is_decode=False, extend_lens=[len(last.input_ids) - split]))
    last.num_computed = len(last.input_ids)
    for i, req in enumerate(reqs[:-1]):
        torch.testing.assert_close(logits[i].cpu(), hf_logits(tiny_models[arch], req.input_ids)[-1], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(tail[0].cpu(), hf_logits(tiny_models[arch], last.input_ids)[-1], atol=2e-4, rtol=1e-4)
    # Three decode steps for every sequence at once.
    for step in range(3):
        for req in reqs:
            req.output_ids.append(100 + step + int(req.rid))
        out = runner.forward(Batch(reqs, is_decode=True, extend_lens=[1] * len(reqs)))
        for i, req in enumerate(reqs):
            req.num_computed += 1
            torch.testing.assert_close(out[i].cpu(), hf_logits(tiny_models[arch], req.fill_ids)[-1], atol=2e-4, rtol=1e-4)


def test_mem_fraction_sizes_the_pool_from_free_memory(tiny_models):
    from pdserve.shared.model_runner import free_memory_bytes

    runner = ModelRunner(RuntimeConfig(model_path=str(tiny_models["llama"]), dtype="float32",
                                       cache=CacheConfig(page_size=16, mem_fraction=0.001)))
    page_bytes = runner.pool.layout.page_bytes
    expected = free_memory_bytes(runner.device) * 0.001 / page_bytes
    assert 0.8 * expected <= runner.pool.num_pages <= 1.2 * expected
    assert runner.pool.buffer.shape[0] == runner.pool.num_pages


def test_sharded_checkpoints_load(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, single = make_runner(tmp_path, "torch"), make_runner(tiny_models["qwen2"], "torch")
    for a, b in zip(sharded.model.layers, single.model.layers):
        for x, y in zip(a.linears(), b.linears()):
            assert torch.equal(x.dense_weight(), y.dense_weight())
        assert torch.equal(a.qkv.bias, b.qkv.bias)
    assert torch.equal(sharded.model.lm_head.dense_weight(), single.model.lm_head.dense_weight())
