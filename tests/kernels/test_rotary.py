from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICES, TRITON_DEVICE, TRITON_DTYPES, assert_close
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pdserve.kernels.rotary import build_cos_sin_cache, cos_sin_rows, rotary_torch, rotary_triton

HEAD_DIM = 32
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_cos_sin(rope_parameters: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config = LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=512, rope_parameters=rope_parameters)
    rope = LlamaRotaryEmbedding(config)
    cos, sin = rope(torch.zeros(1, 1, HEAD_DIM), positions[None])
    return cos[0], sin[0]  # [T, D], both halves equal


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "llama3", **LLAMA3},
    {"type": "llama3", **LLAMA3},  # the older key
])
def test_cache_matches_transformers(scaling):
    theta = 500000.0
    cache = build_cos_sin_cache(HEAD_DIM, 512, theta, scaling, "cpu")
    assert cache.shape == (512, HEAD_DIM) and cache.dtype == torch.float32
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        params = {**LLAMA3, "rope_type": "llama3", "rope_theta": theta}
    cos, sin = hf_cos_sin(params, torch.arange(512))
    half = HEAD_DIM // 2
    assert torch.equal(cache[:, :half], cos[:, :half])
    assert torch.equal(cache[:, half:], sin[:, :half])


def test_llama3_scaling_changes_low_frequencies_only():
    plain = build_cos_sin_cache(HEAD_DIM, 512, 500000.0, None, "cpu")
    scaled = build_cos_sin_cache(HEAD_DIM, 512, 500000.0, {"rope_type": "llama3", **LLAMA3}, "cpu")
    half = HEAD_DIM // 2
    assert torch.equal(plain[:, [0, half]], scaled[:, [0, half]])  # highest frequency untouched
    # The lowest frequency is slowed down by `factor`: its angle at position 511 shrinks 8x.
    torch.testing.assert_close(scaled[511, -1].asin() * 8, plain[511, -1].asin(), rtol=1e-4, atol=0)


def test_unknown_scaling_is_refused():
    with pytest.raises(ValueError, match="yarn"):
        build_cos_sin_cache(HEAD_DIM, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0}, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_torch_reference_matches_transformers(device):
    torch.manual_seed(0)
    positions = torch.tensor([0, 7, 3, 100, 511])
    q = torch.randn(5, 6, HEAD_DIM)
    k = torch.randn(5, 2, HEAD_DIM)
    cache = build_cos_sin_cache(HEAD_DIM, 512, 10000.0, None, device)
    qk = torch.cat([q, k], dim=1).to(device)
    out = rotary_torch(qk, cos_sin_rows(cache, positions.to(device)))
    out_q, out_k = out[:, :6], out[:, 6:]
    assert torch.equal(qk.cpu(), torch.cat([q, k], dim=1))  # input untouched
    cos, sin = hf_cos_sin({"rope_type": "default", "rope_theta": 10000.0}, positions)
    # transformers wants [batch, heads, tokens, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(out_q.cpu(), hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k.cpu(), hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_matches_torch(dtype):
    torch.manual_seed(1)
    T, hq, hk = 5, 6, 2
    # q and k heads as one strided view of a fused projection output, as the model hands them over.
    qkv = torch.randn(T, (hq + 2 * hk) * HEAD_DIM, device=TRITON_DEVICE).to(dtype)
    qk = qkv[:, :(hq + hk) * HEAD_DIM].view(T, hq + hk, HEAD_DIM)
    positions = torch.tensor([0, 1, 9, 250, 511], device=TRITON_DEVICE)
    cache = build_cos_sin_cache(HEAD_DIM, 512, 10000.0, {"rope_type": "llama3", **LLAMA3}, TRITON_DEVICE)
    rows = cos_sin_rows(cache, positions)
    before = qkv.clone()
    out = rotary_triton(qk, rows)
    assert_close(out, rotary_torch(qk, rows), dtype)
    assert torch.equal(qkv, before)
