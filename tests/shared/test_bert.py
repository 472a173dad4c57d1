"""The BERT encoder and its pooling on all-MiniLM-L6-v2 (real weights) against sentence-transformers."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve.shared.pooling import PoolingConfig, pool

TEXTS = ["Hello, world!", "SGLang is fast", "The giant panda is a bear species endemic to China.",
         "one " * 120]


@pytest.fixture(scope="module")
def encoder(minilm_dir):
    from pdserve.shared.encoder import Encoder

    return Encoder(minilm_dir)


def test_pooling_follows_the_sentence_transformers_files(minilm_dir):
    assert PoolingConfig.from_dir(minilm_dir) == PoolingConfig("mean", normalize=True)


@pytest.fixture(scope="module")
def st_vectors(minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    return torch.tensor(st.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS))


def make_encoder(model_dir, monkeypatch, bf16_matmuls: bool, dtype=None):
    """An Encoder as this CPU would build it if its bf16 matmuls did (or did not) pay."""
    from pdserve.shared import linear
    from pdserve.shared.encoder import Encoder

    if bf16_matmuls and not linear._packs_bf16():
        pytest.skip(NO_BF16_PACKING)
    monkeypatch.setattr(linear, "_bf16_matmul", bf16_matmuls)
    return Encoder(model_dir, dtype)


# Where oneDNN cannot pack bf16 weights (an AVX2-only CPU), bf16_matmul_pays() is False and the encoder keeps fp32
# matmuls: the bf16_matmuls=False cases are that fallback and run everywhere.
NO_BF16_PACKING = ("bf16 matmuls need oneDNN to pack bf16 weights, which it refuses on this CPU (it needs "
                   "AVX512-BW/VL/DQ or AVX-NE-CONVERT); the encoder keeps fp32 matmuls here")


@pytest.mark.parametrize("bf16_matmuls", [False, True])
def test_embeddings_match_sentence_transformers(minilm_dir, st_vectors, monkeypatch, bf16_matmuls):
    from transformers import AutoTokenizer

    encoder = make_encoder(minilm_dir, monkeypatch, bf16_matmuls)
    assert encoder.dtype == torch.float32  # the checkpoint's: activations, norms and outputs
    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    ours = torch.tensor(encoder.encode([tok.encode(t) for t in TEXTS]))
    cosine = torch.nn.functional.cosine_similarity(ours, st_vectors)
    assert cosine.min() >= 0.9999, cosine
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    if encoder.matmul_dtype == torch.bfloat16:
        assert cosine.min() < 0.999999  # the bf16 path did run: its vectors are close, not equal


def test_an_explicit_float32_keeps_fp32_matmuls(minilm_dir, monkeypatch):
    from pdserve.shared.linear import Bf16MatmulLinear, Linear

    auto = make_encoder(minilm_dir, monkeypatch, True)
    assert auto.matmul_dtype == torch.bfloat16 and type(auto.model.layers[0].up) is Bf16MatmulLinear
    strict = make_encoder(minilm_dir, monkeypatch, True, torch.float32)
    assert strict.matmul_dtype == torch.float32 and type(strict.model.layers[0].up) is Linear


@pytest.mark.parametrize("bf16_matmuls", [False, True])
def test_an_input_gets_the_same_vector_alone_or_padded_in_a_batch(minilm_dir, monkeypatch, bf16_matmuls):
    encoder = make_encoder(minilm_dir, monkeypatch, bf16_matmuls)
    short, long = [101, 7592, 2088, 102], [101] + [2028] * 60 + [102]
    alone = torch.tensor(encoder.encode([short]))
    batched = torch.tensor(encoder.encode([long, short, long]))
    if encoder.matmul_dtype == torch.float32:
        assert torch.allclose(alone[0], batched[1], atol=1e-5)
    else:  # bf16 attention sums a padded row in other blocks: the same vector within bf16 rounding
        assert torch.nn.functional.cosine_similarity(alone[0], batched[1], dim=0) >= 0.9999
        assert torch.allclose(alone[0], batched[1], atol=3e-3)
    # Padding leaking into attention would move it far more than rounding does.
    assert not torch.allclose(alone[0], torch.tensor(encoder.encode([short[:3] + [1012, 102]]))[0], atol=3e-3)


def test_queued_requests_are_answered_in_order(encoder):
    encoder.start()
    try:
        futures = [encoder.submit([[101, 2000 + k, 102]] * (k + 1)) for k in range(4)]
        results = [f.result(timeout=30) for f in futures]
    finally:
        encoder.stop()
    assert [len(r) for r in results] == [1, 2, 3, 4]
    direct = encoder.encode([[101, 2003, 102]])
    assert torch.allclose(torch.tensor(results[3][0]), torch.tensor(direct[0]), atol=1e-5)


@pytest.mark.parametrize("seq,message", [([], "empty"), ([5] * 513, "context length"), ([30522], "vocabulary")])
def test_bad_inputs_are_refused(encoder, seq, message):
    with pytest.raises(ValueError, match=message):
        encoder.submit([seq])


@pytest.mark.parametrize("mode", ["cls", "mean", "max", "mean_sqrt_len", "last"])
def test_pooling_modes_ignore_padding(mode):
    hidden = torch.randn(2, 5, 8)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    config = PoolingConfig(mode, normalize=False)
    got = pool(hidden, mask, config)
    alone = pool(hidden[1:, :3], mask[1:, :3], config)
    assert torch.allclose(got[1], alone[0], atol=1e-6)


def test_matryoshka_is_read_from_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [64, 128]}))
    config = PoolingConfig.from_dir(tmp_path)
    assert config.matryoshka and config.matryoshka_dims == (64, 128) and config.mode == "cls"
