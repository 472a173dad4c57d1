"""LoRA adapters: PEFT checkpoints fused into the runtime's layout (checked against PEFT's own modules), every
refusal, and the slot pool's bookkeeping. Tiny random Llamas keep it fast; one test uses the default model."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_adapters import load_peft_model, make_peft_adapter, make_tiny_llama
from pdserve.shared.config import ModelConfig, MoeConfig
from pdserve.shared.lora import (FUSED_LINEARS, SUPPORTED_TARGETS, LoraAdapter, LoraError, LoraPool, LoraWeights,
                                 linear_shapes)
from pdserve.shared.lora_checkpoint import load_adapter
from pdserve.shared.lora_registry import LoraRegistry

PARTIAL = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")  # leaves k_proj and up_proj alone


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def base(root) -> Path:
    return make_tiny_llama(root / "base")  # hidden 64, 4 q heads and 2 kv heads of 16, MLP 96, 2 layers


@pytest.fixture(scope="module")
def cfg(base) -> ModelConfig:
    return ModelConfig.from_dir(base)


@pytest.fixture(scope="module")
def full_dir(base, root) -> Path:
    return make_peft_adapter(base, root / "full", rank=4, target_modules=SUPPORTED_TARGETS, alpha=8, seed=1)


@pytest.fixture(scope="module")
def partial_dir(base, root) -> Path:
    return make_peft_adapter(base, root / "partial", rank=4, target_modules=PARTIAL, alpha=16, seed=2,
                             use_rslora=True)


@pytest.fixture(scope="module")
def qv_dir(base, root) -> Path:
    return make_peft_adapter(base, root / "qv", rank=2, target_modules=("q_proj", "v_proj"), alpha=4, seed=3)


@pytest.fixture(scope="module")
def peft_models(base, full_dir, partial_dir):
    return {"full": load_peft_model(base, full_dir), "partial": load_peft_model(base, partial_dir)}


def load(path: Path, cfg: ModelConfig, name: str = "sql", **kwargs) -> LoraAdapter:
    return load_adapter(name, path, cfg, max_rank=kwargs.pop("max_rank", 8), **kwargs)


def peft_module(peft_model, layer: int, module: str) -> torch.nn.Module:
    block = peft_model.base_model.model.model.layers[layer]
    return getattr(block.mlp if module in ("gate_proj", "up_proj", "down_proj") else block.self_attn, module)


def assert_matches_peft(adapter: LoraAdapter, peft_model, cfg: ModelConfig) -> None:
    """Every fused A and B holds PEFT's lora_A and scaling * lora_B in its sub-module's rows; the rest is zero,
    and a linear none of whose sub-modules PEFT wrapped is absent."""
    shapes, r = linear_shapes(cfg), adapter.rank
    for layer in range(cfg.num_layers):
        for linear, modules in FUSED_LINEARS.items():
            offsets = shapes[linear].out_offsets
            wrapped = [hasattr(peft_module(peft_model, layer, m), "lora_A") for m in modules]
            if not any(wrapped):
                assert (layer, linear) not in adapter.weights
                continue
            a, b = adapter.weights[(layer, linear)]
            assert a.shape == (len(modules) * r, shapes[linear].in_features) and b.shape == (offsets[-1], r)
            for j, module in enumerate(modules):
                rows_a, rows_b = a[j * r:(j + 1) * r], b[offsets[j]:offsets[j + 1]]
                if not wrapped[j]:
                    assert not rows_a.any() and not rows_b.any()
                    continue
                lora = peft_module(peft_model, layer, module)
                assert lora.scaling["default"] == pytest.approx(adapter.scaling)
                torch.testing.assert_close(rows_a, lora.lora_A["default"].weight, rtol=0, atol=0)
                torch.testing.assert_close(rows_b, lora.lora_B["default"].weight * adapter.scaling)


def lora_apply_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         out_offsets: tuple[int, ...], row_slots: list[int]) -> torch.Tensor:
    """The contract the LoRA op implements: row t adds its slot's LoRA (slot -1: none)."""
    R = lora_b.shape[-1]
    y = x.new_zeros(x.shape[0], out_offsets[-1])
    for t, slot in enumerate(row_slots):
        if slot < 0:
            continue
        h = x[t:t + 1] @ lora_a[slot].T  # [1, n_sub * R]
        for j in range(len(out_offsets) - 1):
            lo, hi = out_offsets[j], out_offsets[j + 1]
            y[t:t + 1, lo:hi] += h[:, j * R:(j + 1) * R] @ lora_b[slot, lo:hi].T
    return y


def padded(weights: LoraWeights | None, shape, max_rank: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_sub = len(shape.out_sizes)
    a, b = torch.zeros(n_sub * max_rank, shape.in_features), torch.zeros(shape.out_offsets[-1], max_rank)
    if weights is not None:
        a.view(n_sub, max_rank, -1)[:, :rank] = weights.a.view(n_sub, rank, -1)
        b[:, :rank] = weights.b
    return a, b


def assert_slot_holds(pool: LoraPool, slot: int, adapter: LoraAdapter | None, cfg: ModelConfig) -> None:
    """White-box: every covered linear, including those `layer()` hides because no adapter changes them (a
    stale weight there would surface once another slot's adapter does)."""
    for (layer, linear), shape in ((k, linear_shapes(cfg)[k[1]]) for k in pool._layers):
        tensors = pool._layers[(layer, linear)]
        weights = adapter.weights.get((layer, linear)) if adapter else None
        a, b = padded(weights, shape, pool.max_rank, adapter.rank if adapter else 0)
        assert torch.equal(tensors.lora_a[slot], a) and torch.equal(tensors.lora_b[slot], b), (layer, linear)
    assert pool.ranks[slot].item() == (adapter.rank if adapter else 0)


# ---------------------------------------------------------------- loading
@pytest.mark.parametrize("which", ["full", "partial"])
def test_fused_weights_match_peft(which, cfg, full_dir, partial_dir, peft_models):
    adapter = load(full_dir if which == "full" else partial_dir, cfg)
    assert adapter.rank == 4
    if which == "full":
        assert adapter.scaling == 8 / 4 and adapter.target_modules == SUPPORTED_TARGETS
    else:  # rsLoRA: alpha / sqrt(r)
        assert adapter.scaling == 16 / 2 and adapter.target_modules == PARTIAL
    assert_matches_peft(adapter, peft_models[which], cfg)
    assert all(w.a.dtype == torch.float32 for w in adapter.weights.values())


@pytest.mark.parametrize("linear", list(FUSED_LINEARS))
def test_pool_layout_reproduces_peft_outputs(linear, cfg, full_dir, partial_dir, peft_models):
    """x @ W.T plus the pool's LoRA for each row's slot equals PEFT's wrapped modules, row by row."""
    pool = LoraPool(cfg, max_loras=3, max_rank=8)
    slots = {"full": pool.acquire(load(full_dir, cfg, "full")),
             "partial": pool.acquire(load(partial_dir, cfg, "partial"))}
    row_slots = [slots["partial"], slots["full"], -1, slots["partial"], -1, slots["full"]]
    layer = 1
    lora = pool.layer(layer, linear)
    assert lora is not None
    x = torch.randn(len(row_slots), lora.lora_a.shape[-1], generator=torch.Generator().manual_seed(0))
    modules = [peft_module(peft_models["full"], layer, m) for m in FUSED_LINEARS[linear]]
    fused_w = torch.cat([m.base_layer.weight for m in modules])  # the model's fused weight
    y = x @ fused_w.T + lora_apply_reference(x, lora.lora_a, lora.lora_b, lora.out_offsets, row_slots)
    with torch.no_grad():
        expected = {which: torch.cat([peft_module(model, layer, m)(x) for m in FUSED_LINEARS[linear]], dim=1)
                    for which, model in peft_models.items()}
        expected["base"] = x @ fused_w.T
    for t, slot in enumerate(row_slots):
        which = {slots["full"]: "full", slots["partial"]: "partial", -1: "base"}[slot]
        torch.testing.assert_close(y[t], expected[which][t], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected["partial"], expected["base"], atol=1e-3)  # the adapters do change it


def test_default_model_qkv_matches_peft(default_model_dir, tmp_path):
    """The real model's grouped-query shapes (9 q heads, 3 kv heads): one layer's qkv against PEFT."""
    cfg = ModelConfig.from_dir(default_model_dir)
    qkv = ("q_proj", "k_proj", "v_proj")
    path = make_peft_adapter(default_model_dir, tmp_path / "smol", rank=8, target_modules=qkv, alpha=16, seed=4,
                             use_rslora=True, layers_to_transform=[3])
    peft_model = load_peft_model(default_model_dir, path)
    pool = LoraPool(cfg, max_loras=2, max_rank=16, target_modules=qkv)
    slot = pool.acquire(load(path, cfg, max_rank=16, target_modules=qkv))
    assert pool.layer(2, "qkv") is None and pool.layer(3, "o") is None
    lora = pool.layer(3, "qkv")
    x = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    modules = [peft_module(peft_model, 3, m) for m in qkv]
    fused_w = torch.cat([m.base_layer.weight for m in modules])
    y = x @ fused_w.T + lora_apply_reference(x, lora.lora_a, lora.lora_b, lora.out_offsets, [slot] * 4)
    with torch.no_grad():
        expected = torch.cat([m(x) for m in modules], dim=1)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kwargs, keys", [
    ({"target_modules": r".*\.layers\.1\.self_attn\.(q|k)_proj"}, {(1, "qkv")}),  # a regex, as PEFT allows
    ({"target_modules": ("q_proj", "down_proj"), "layers_to_transform": [1]}, {(1, "qkv"), (1, "down")}),
    ({"target_modules": ("q_proj", "down_proj"), "exclude_modules": ["model.layers.0.mlp.down_proj"]},
     {(0, "qkv"), (1, "qkv"), (1, "down")}),
    ({"target_modules": "all-linear"}, {(i, lin) for i in range(2) for lin in FUSED_LINEARS}),
])
def test_module_selection_honoured_like_peft(kwargs, keys, base, cfg, tmp_path):
    path = make_peft_adapter(base, tmp_path / "sel", rank=2, alpha=4, seed=5, **kwargs)
    adapter = load(path, cfg)
    assert set(adapter.weights) == keys
    assert_matches_peft(adapter, load_peft_model(base, path), cfg)


def test_all_linear_shorthand_in_config(full_dir, cfg, tmp_path):
    path = edited_copy(full_dir, tmp_path, {"target_modules": "all-linear"})
    assert set(load(path, cfg).weights) == set(load(full_dir, cfg).weights)


def test_version_follows_content(full_dir, partial_dir, cfg, tmp_path):
    copy = Path(shutil.copytree(full_dir, tmp_path / "copy"))
    version = load(full_dir, cfg).version
    assert len(version) == 16 and int(version, 16) >= 0
    assert load(copy, cfg, "other-name").version == version  # content, not name or path
    assert load(partial_dir, cfg).version != version


def test_bf16_weights_on_request(full_dir, cfg):
    adapter = load(full_dir, cfg, dtype=torch.bfloat16)
    full = load(full_dir, cfg)
    assert all(w.b.dtype == torch.bfloat16 for w in adapter.weights.values())
    torch.testing.assert_close(adapter.weights[(0, "qkv")].b.float(), full.weights[(0, "qkv")].b,
                               rtol=1e-2, atol=1e-3)


def test_attention_adapter_on_moe_model(qv_dir, cfg):
    moe_cfg = dataclasses.replace(cfg, moe=MoeConfig(4, 2, 32, True, 0, (0, 1)))
    assert set(load(qv_dir, moe_cfg).weights) == {(0, "qkv"), (1, "qkv")}
    pool = LoraPool(moe_cfg, max_loras=1, max_rank=4)
    assert {linear for _, linear in pool._layers} == {"qkv", "o"}  # no slots for expert MLPs


# ---------------------------------------------------------------- refusals
def edited_copy(src: Path, tmp_path: Path, updates: dict) -> Path:
    dst = Path(shutil.copytree(src, tmp_path / "edited"))
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(updates)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def refused(path: Path, cfg: ModelConfig, **kwargs) -> str:
    with pytest.raises(LoraError) as info:
        load(path, cfg, **kwargs)
    message = str(info.value)
    assert message.startswith("adapter 'sql': "), message
    return message


@pytest.mark.parametrize("updates, problem", [
    ({"peft_type": "IA3"}, "peft_type is 'IA3'; only LORA adapters"),
    ({"use_dora": True}, "DoRA is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save (fully trained copies of base modules) is not supported"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"lora_bias": True}, "a LoRA bias (lora_bias) is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "per-module ranks (rank_pattern)"),
    ({"r": 0}, "rank r must be a positive integer, got 0"),
    ({"r": 8}, "has shape [4, 64], but this base model needs [8, 64]"),  # the config disagrees with the file
    ({"target_modules": ["q_proj", "foo_proj"]}, "unsupported target module 'foo_proj' (supported: q_proj"),
    ({"target_modules": ["q_proj", "lm_head"]}, "targets lm_head; only the decoder layers' linear modules"),
    ({"target_modules": ["embed_tokens"]}, "targets embed_tokens"),
    ({"target_modules": r".*\.experts\..*"}, "matches no module of this base model"),
    ({"target_modules": "(["}, "target_modules '([' is not a valid regex"),
    ({"target_modules": None}, "names no target_modules"),
    ({"target_modules": ".*q_proj", "layers_to_transform": [0]}, "layers_to_transform cannot be combined"),
    ({"layers_to_transform": [5]}, "matches no module of this base model"),
    ({"layers_to_transform": [0], "layers_pattern": "h"}, "layers_pattern 'h' does not name this model's layers"),
])
def test_config_refusals(updates, problem, full_dir, cfg, tmp_path):
    assert problem in refused(edited_copy(full_dir, tmp_path, updates), cfg)


def test_rank_above_limit_refused(full_dir, cfg):
    assert refused(full_dir, cfg, max_rank=2) == "adapter 'sql': rank 4 exceeds --max-lora-rank 2"


def test_targets_outside_allow_list_refused(full_dir, qv_dir, cfg):
    allow = ("q_proj", "k_proj", "v_proj")
    assert "targets o_proj, gate_proj, up_proj, down_proj, not in --lora-target-modules (q_proj, k_proj, v_proj)" \
        in refused(full_dir, cfg, target_modules=allow)
    assert load(qv_dir, cfg, target_modules=allow).target_modules == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="--lora-target-modules: lm_head"):
        load(qv_dir, cfg, target_modules=("q_proj", "lm_head"))


def test_mlp_adapter_on_moe_model_refused(full_dir, cfg):
    moe_cfg = dataclasses.replace(cfg, moe=MoeConfig(4, 2, 32, True, 0, (0, 1)))
    assert "targets gate_proj, up_proj, down_proj, but this is a Mixture-of-Experts model" in refused(full_dir, moe_cfg)


def test_real_dora_adapter_refused(base, cfg, tmp_path):
    path = make_peft_adapter(base, tmp_path / "dora", rank=2, target_modules=("q_proj",), alpha=4, seed=6,
                             use_dora=True)
    assert "DoRA is not supported (use_dora = True)" in refused(path, cfg)


def test_adapter_of_another_base_model_refused(cfg, root, tmp_path):
    other = make_tiny_llama(root / "other-base", hidden_size=96)
    path = make_peft_adapter(other, tmp_path / "other", rank=4, target_modules=("q_proj", "v_proj"), alpha=8, seed=7)
    message = refused(path, cfg)
    assert "tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [4, 96], " \
           "but this base model needs [4, 64] (is the adapter for another base model?)" in message


def test_file_refusals(full_dir, cfg, tmp_path):
    assert "does not exist" in refused(tmp_path / "nowhere", cfg)
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in refused(tmp_path / "file", cfg)

    no_config = Path(shutil.copytree(full_dir, tmp_path / "no-config"))
    (no_config / "adapter_config.json").unlink()
    assert "no adapter_config.json in" in refused(no_config, cfg)

    no_weights = Path(shutil.copytree(full_dir, tmp_path / "no-weights"))
    (no_weights / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors in" in refused(no_weights, cfg)
    (no_weights / "adapter_model.bin").write_bytes(b"pickle")
    assert "adapter_model.bin, a pickle, which is not loaded" in refused(no_weights, cfg)

    bad_json = Path(shutil.copytree(full_dir, tmp_path / "bad-json"))
    (bad_json / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json is not valid JSON" in refused(bad_json, cfg)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weights_refused(damage, full_dir, cfg, tmp_path):
    path = Path(shutil.copytree(full_dir, tmp_path / "corrupt"))
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x07" * 64 if damage == "garbage" else data[:len(data) // 2])
    assert "adapter_model.safetensors is not a valid safetensors file" in refused(path, cfg)


@pytest.mark.parametrize("change, problem", [
    ("drop", "lacks base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
    ("extra", "unexpected tensor base_model.model.model.lm_head.lora_A.weight"),
    ("nan", "tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight is not finite"),
])
def test_tensor_refusals(change, problem, full_dir, cfg, tmp_path):
    path = Path(shutil.copytree(full_dir, tmp_path / "tensors"))
    tensors = load_file(path / "adapter_model.safetensors")
    if change == "drop":
        del tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    elif change == "extra":
        tensors["base_model.model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    else:
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0] = float("nan")
    save_file(tensors, path / "adapter_model.safetensors")
    assert problem in refused(path, cfg)


# ---------------------------------------------------------------- pool
def test_pool_holds_adapter_zero_padded(partial_dir, cfg):
    pool = LoraPool(cfg, max_loras=2, max_rank=8)
    adapter = load(partial_dir, cfg)
    assert pool.layer(0, "qkv") is None  # nothing loaded: every LoRA op skipped
    assert pool.acquire(adapter) == 0 and pool.slot_of("sql") == 0 and pool.in_use("sql") == 1
    assert_slot_holds(pool, 0, adapter, cfg)
    assert_slot_holds(pool, 1, None, cfg)
    assert pool.ranks.tolist() == [4, 0] and pool.ranks.dtype == torch.int32
    for layer in range(cfg.num_layers):
        for linear in FUSED_LINEARS:  # up_proj untouched, but gate_proj shares gate_up
            assert pool.layer(layer, linear) is not None
        assert pool.layer(layer, "qkv").out_offsets == (0, 64, 96, 128)


def test_slot_reuse_zeroes_the_old_adapter(full_dir, qv_dir, cfg):
    pool = LoraPool(cfg, max_loras=1, max_rank=8)
    full, qv = load(full_dir, cfg, "full"), load(qv_dir, cfg, "qv")
    pool.acquire(full)
    pool.release("full")
    assert pool.acquire(qv) == 0 and pool.slot_of("full") is None
    assert_slot_holds(pool, 0, qv, cfg)  # k rows, o, gate_up and down all back to zero
    assert pool.ranks.tolist() == [2]
    assert pool.layer(0, "qkv") is not None
    assert all(pool.layer(i, lin) is None for i in range(2) for lin in ("o", "gate_up", "down"))


def test_lru_eviction_spares_running_adapters(full_dir, partial_dir, qv_dir, cfg):
    pool = LoraPool(cfg, max_loras=2, max_rank=8)
    a, b, c = load(full_dir, cfg, "a"), load(partial_dir, cfg, "b"), load(qv_dir, cfg, "c")
    assert (pool.acquire(a), pool.acquire(b)) == (0, 1)
    assert not pool.can_acquire("c") and pool.can_acquire("a")
    with pytest.raises(LoraError, match="adapter 'c': all 2 LoRA slots hold adapters of running requests"):
        pool.acquire(c)
    assert pool.slot_of("a") == 0 and pool.slot_of("b") == 1  # the failed acquire changed nothing
    pool.release("b")
    pool.release("a")
    assert pool.acquire(a) == 0 and pool.in_use("a") == 1  # a is used again: b is now least recent
    pool.release("a")
    assert pool.can_acquire("c") and pool.acquire(c) == 1
    assert pool.slot_of("b") is None and pool.slot_of("a") == 0
    assert_slot_holds(pool, 1, c, cfg)
    # a running request pins its adapter: the idle a goes, even though c was used more recently
    pool.release("c")
    pool.acquire(c)
    assert pool.acquire(b) == 0 and pool.slot_of("a") is None


def test_evict_and_release_rules(full_dir, cfg):
    pool = LoraPool(cfg, max_loras=2, max_rank=8)
    adapter = load(full_dir, cfg)
    pool.acquire(adapter)
    pool.acquire(adapter)
    assert pool.in_use("sql") == 2
    with pytest.raises(LoraError, match="adapter 'sql': cannot evict it while 2 running requests use it"):
        pool.evict("sql")
    pool.release("sql")
    pool.release("sql")
    with pytest.raises(RuntimeError, match="adapter 'sql': released more often than acquired"):
        pool.release("sql")
    pool.evict("sql")
    assert pool.slot_of("sql") is None and pool.in_use("sql") == 0
    assert_slot_holds(pool, 0, None, cfg)
    assert pool.layer(0, "qkv") is None
    pool.evict("never-loaded")  # nothing to do


def test_pool_covers_only_allowed_targets(full_dir, qv_dir, cfg):
    pool = LoraPool(cfg, max_loras=1, max_rank=8, target_modules=("v_proj", "q_proj"))
    assert pool.target_modules == ("q_proj", "v_proj")
    with pytest.raises(LoraError, match="adapter 'sql': changes o, gate_up, down, which the LoRA slots do not cover"):
        pool.acquire(load(full_dir, cfg))
    pool.acquire(load(qv_dir, cfg, "qv"))
    assert pool.layer(1, "qkv") is not None and pool.layer(1, "o") is None
    with pytest.raises(LoraError, match="adapter 'big': rank 4 exceeds --max-lora-rank 2"):
        LoraPool(cfg, max_loras=1, max_rank=2).acquire(load(full_dir, cfg, "big"))
    with pytest.raises(ValueError, match="--max-loras-per-batch must be >= 1"):
        LoraPool(cfg, max_loras=0, max_rank=8)


# ---------------------------------------------------------------- registry
def test_registry_load_and_unload(full_dir, partial_dir, cfg, tmp_path):
    registry = LoraRegistry(LoraPool(cfg, max_loras=2, max_rank=8))
    adapter = registry.load("sql", full_dir)
    assert registry.get("sql") is adapter and "sql" in registry and registry.names() == ["sql"]
    assert registry.load("sql", full_dir) is adapter  # the same files again: the loaded adapter
    with pytest.raises(LoraError, match=f"adapter 'sql' is already loaded from {full_dir}; unload it first"):
        registry.load("sql", partial_dir)
    with pytest.raises(LoraError, match="adapter 'bad': rank 4 exceeds"):
        LoraRegistry(LoraPool(cfg, max_loras=1, max_rank=2)).load("bad", full_dir)
    with pytest.raises(LoraError, match="adapter 'gone': .* does not exist"):
        registry.load("gone", tmp_path / "nowhere")
    assert registry.names() == ["sql"]  # failed loads left nothing behind

    registry.pool.acquire(adapter)
    with pytest.raises(LoraError, match="adapter 'sql': cannot unload it while 1 running requests use it"):
        registry.unload("sql")
    registry.pool.release("sql")
    registry.unload("sql")
    assert "sql" not in registry and registry.pool.slot_of("sql") is None
    with pytest.raises(LoraError, match=r"adapter 'sql' is not loaded \(loaded: none\)"):
        registry.get("sql")


def test_registry_refuses_changed_files_under_a_loaded_name(full_dir, partial_dir, cfg, tmp_path):
    path = Path(shutil.copytree(full_dir, tmp_path / "moving"))
    registry = LoraRegistry(LoraPool(cfg, max_loras=1, max_rank=8))
    old = registry.load("sql", path)
    shutil.copy(partial_dir / "adapter_model.safetensors", path / "adapter_model.safetensors")
    shutil.copy(partial_dir / "adapter_config.json", path / "adapter_config.json")
    with pytest.raises(LoraError, match="adapter 'sql': its files in .* changed since it was loaded"):
        registry.load("sql", path)
    assert registry.get("sql") is old
    # once unloaded, the new files load, and the pool replaces the old weights in the slot
    registry.pool.acquire(old)
    registry.pool.release("sql")
    registry.unload("sql")
    new = registry.load("sql", path)
    assert registry.pool.acquire(new) == 0
    assert_slot_holds(registry.pool, 0, new, cfg)
