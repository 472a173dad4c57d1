"""The runtime's forward pass against transformers, on tiny random checkpoints of each architecture."""
from __future__ import annotations

import functools

import pytest
import torch

from fixtures import ARCHS, MOE_ARCHS

from pdserve.shared.config import CacheConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from pdserve.shared.engine import Engine
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
# The interpreter is slow: there Triton skips the archs whose kernels it already runs in another (qwen3-moe has
# Qwen3's q/k norm, experts and a dense layer; Mixtral differs from it only in routing and weight names).
INTERPRETER_SKIPS = {"qwen3", "mixtral"}
PARITY_CASES = [(device, backend, arch) for device, backend in BACKENDS for arch in ARCHS
                if not (backend == "triton" and not CUDA and arch in INTERPRETER_SKIPS)]
PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66], [1, 2, 3], [400, 401, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@functools.lru_cache(maxsize=None)
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0].float()  # [len, V]


def make_runner(model_dir, backend: str, device: str = "cpu", page_size: int = 4) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model_path=str(model_dir), dtype="float32", kernels=backend,
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


@pytest.mark.parametrize("device,backend,arch", PARITY_CASES)
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


@pytest.mark.parametrize("arch", ["qwen3", *MOE_ARCHS])
def test_greedy_tokens_match_transformers_chunked_and_cached(tiny_models, arch):
    """Whole engine, native kernels: prompts prefilled in 4-token chunks, then again from the prefix cache."""
    new_tokens = 10
    model = hf_model(tiny_models[arch])
    with torch.no_grad():
        expected = [model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]
    engine = Engine(RuntimeConfig(model_path=str(tiny_models[arch]), dtype="float32",
                                  cache=CacheConfig(page_size=4, max_total_tokens=4 * 64),
                                  scheduler=SchedulerConfig(chunked_prefill_size=4, max_prefill_tokens=8)))
    for attempt in range(2):
        outputs: dict[str, list[int]] = {}
        cached: dict[str, int] = {}

        def collect(out):
            outputs.setdefault(out.rid, []).extend(out.token_ids)
            cached[out.rid] = out.cached_tokens

        for i, ids in enumerate(PROMPTS):
            engine.add_request(Req(rid=f"{attempt}-{i}", input_ids=list(ids), on_output=collect,
                                   params=SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                                         min_new_tokens=new_tokens)))
        while engine.has_work():
            engine.step()
        assert [outputs[f"{attempt}-{i}"] for i in range(len(PROMPTS))] == expected
        if attempt == 1:  # all of each prompt but its last token came from the cache, past its whole pages
            assert [cached[f"1-{i}"] for i in range(len(PROMPTS))] == [len(p) - 1 for p in PROMPTS], cached


@pytest.mark.parametrize("arch,experts,top_k,sparse,shared,renorm", [
    ("qwen2-moe", 8, 2, (0, 1), 96, False), ("qwen3-moe", 8, 2, (0, 2), 0, True), ("mixtral", 4, 2, (0, 1), 0, True)])
def test_moe_config_is_read_from_each_family(tiny_models, arch, experts, top_k, sparse, shared, renorm):
    moe = ModelConfig.from_dir(tiny_models[arch]).moe
    assert (moe.num_experts, moe.top_k, moe.sparse_layers) == (experts, top_k, sparse)
    assert (moe.shared_expert_intermediate_size, moe.norm_topk_prob) == (shared, renorm)


def test_route_hook_sees_every_sparse_layer(tiny_models):
    runner = make_runner(tiny_models["qwen3-moe"], "torch")
    seen: list[tuple[int, tuple[int, ...]]] = []
    runner.model.set_route_hook(lambda layer, ids: seen.append((layer, tuple(ids.shape))))
    reqs = make_reqs(runner, PROMPTS[:2])
    runner.forward(Batch(reqs, is_decode=False, extend_lens=[len(r.input_ids) for r in reqs]))
    rows = sum(len(p) for p in PROMPTS[:2])
    assert seen == [(0, (rows, 2)), (2, (rows, 2))]  # layer 1 is dense (mlp_only_layers)


def test_unsupported_architecture_is_refused_by_name(tiny_models, tmp_path):
    import json
    import shutil

    shutil.copytree(tiny_models["llama"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        make_runner(tmp_path / "m", "torch")
    assert all(name in str(err.value) for name in ("Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"))


def test_stacked_expert_tensors_load_like_per_expert_ones(tiny_models, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_models["qwen3-moe"]
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(src / "model.safetensors")
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts."
        per = [[tensors.pop(f"{p}{e}.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")] for e in range(8)]
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in per])
        tensors[p + "down_proj"] = torch.stack([d for _, _, d in per])
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    stacked, plain = make_runner(tmp_path / "m", "torch"), make_runner(src, "torch")
    checked = 0
    for a, b in zip(stacked.model.layers, plain.model.layers):
        if hasattr(a.mlp, "experts"):
            assert torch.equal(a.mlp.experts.w13, b.mlp.experts.w13) and torch.equal(a.mlp.experts.w2, b.mlp.experts.w2)
            checked += 1
    assert checked == 2


@pytest.mark.parametrize("has_bf16, checkpoint, expected", [
    (True, "bfloat16", torch.bfloat16), (False, "bfloat16", torch.float32), (True, "float16", torch.bfloat16),
    (False, "float16", torch.float32), (False, "float32", torch.float32)])
def test_dtype_auto_picks_what_this_cpu_computes_fastest(monkeypatch, has_bf16, checkpoint, expected):
    from pdserve.shared import model_runner

    monkeypatch.setattr(model_runner, "cpu_has_bf16", lambda: has_bf16)
    assert model_runner.resolve_dtype("auto", checkpoint, "cpu") == expected
    assert model_runner.resolve_dtype("bfloat16", checkpoint, "cpu") == torch.bfloat16  # asked for: kept
    assert model_runner.resolve_dtype("auto", checkpoint, "cuda") == getattr(torch, checkpoint)
