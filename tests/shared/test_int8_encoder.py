"""`--quantization w8a8_int8` on the Encoder: the int8 layer against float matmuls, and all-MiniLM-L6-v2's
embeddings and a cross-encoder's scores in int8 against the same models in fp32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.shared.int8_linear import Int8Linear

TEXTS = ["Hello, world!", "!!!", "12345", "SGLang is fast", "a cat sat on the mat",
         "The giant panda is a bear species endemic to China.",
         "Where can I buy cheap flights to Tokyo next month?",
         "Photosynthesis converts light energy into chemical energy stored in glucose.",
         "def add(a, b):\n    return a + b", "one " * 120,
         "The committee will meet again next Thursday to discuss the budget for the new library, which has "
         "been delayed twice by the council's disagreements over its location and its cost."]
QUERIES = ["what do pandas eat?", "how do plants make food?", "python function that sums two numbers",
           "cheap air travel to Japan"]
DOCS = ["Giant pandas feed almost entirely on bamboo shoots and leaves.",
        "Plants use sunlight, water and carbon dioxide to produce sugar through photosynthesis.",
        "def add(a, b): return a + b",
        "Budget airlines offer low fares to Tokyo and Osaka.",
        "The stock market fell sharply on Monday."]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_an_int8_layer_is_close_to_the_float_matmul_and_smoothing_tames_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 64, generator=gen) * 0.1, torch.randn(96, generator=gen)
    x = torch.randn(200, 64, generator=gen)
    x[:, 5] *= 30  # an outlier channel, as the residual stream of a BERT has
    want = F.linear(x, w, bias)
    plain = Int8Linear(w, bias)(x)
    smoothed = Int8Linear(w, bias, input_absmax=x.abs().amax(0))(x)
    assert plain.shape == smoothed.shape == (200, 96) and plain.dtype == torch.float32
    assert relative_error(smoothed, want) < 0.01
    assert relative_error(smoothed, want) < 0.5 * relative_error(plain, want)
    residual = torch.randn(200, 96, generator=gen)
    torch.testing.assert_close(Int8Linear(w, bias)(x, residual=residual), plain + residual)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from transformers import AutoTokenizer

    from pdserve.shared.encoder import Encoder

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    return tok, Encoder(minilm_dir, torch.float32), Encoder(minilm_dir, quantization="w8a8_int8")


def embed(encoder, tok, texts: list[str]) -> torch.Tensor:
    return torch.tensor(encoder.encode([tok.encode(t) for t in texts]))


def test_int8_embeddings_stay_close_to_fp32(minilm):
    tok, fp32, int8 = minilm
    cosine = F.cosine_similarity(embed(int8, tok, TEXTS), embed(fp32, tok, TEXTS))
    assert cosine.min() >= 0.99 and cosine.mean() >= 0.998, cosine
    assert torch.allclose(embed(int8, tok, TEXTS).norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_int8_embeddings_retrieve_what_fp32_retrieves(minilm):
    tok, fp32, int8 = minilm

    def ranking(encoder) -> list[list[int]]:
        scores = embed(encoder, tok, QUERIES) @ embed(encoder, tok, DOCS).t()
        return scores.argsort(dim=1, descending=True).tolist()

    want = ranking(fp32)
    assert [r[0] for r in want] == [0, 1, 2, 3]  # the documents written for each query
    assert [r[:2] for r in ranking(int8)] == [r[:2] for r in want]


def int8_mm_is_exact() -> bool:
    """Whether torch._int_mm sums int8 products exactly on this CPU: with VNNI or AMX it does; without (AVX2-only
    CPUs) oneDNN's s8s8 kernel adds pairs of products in int16 (vpmaddubsw), which saturates on large pairs."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (4, 256), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (256, 32), generator=gen, dtype=torch.int8)
    return torch.equal(torch._int_mm(q, w), (q.double() @ w.double()).to(torch.int32))


def test_an_int8_input_gets_the_same_vector_alone_or_padded_in_a_batch(minilm):
    """Rows are quantized one by one, so padding changes nothing but float rounding in the attention, which a
    value near a rounding boundary turns into one step of int8: the vectors agree to quantization noise."""
    _, _, int8 = minilm
    short, long = [101, 7592, 2088, 102], [101] + [2028] * 60 + [102]
    alone = torch.tensor(int8.encode([short]))
    batched = torch.tensor(int8.encode([long, short, long]))
    # Exact int8 sums (VNNI, AMX): the 0.999 bound holds on the AVX-512 machines. Saturating ones (AVX2 without
    # VNNI) move a step's rounding into more outputs: 0.9989 measured on an AVX2-only AMD EPYC (issue 29).
    bound = 0.999 if int8_mm_is_exact() else 0.998
    assert F.cosine_similarity(alone[0], batched[1], dim=0) >= bound


def test_int8_cross_encoder_scores_keep_their_order(tmp_path, minilm_dir):
    from pooling_models import make_cross_encoder
    from transformers import AutoTokenizer

    from pdserve.shared.encoder import Encoder

    model_dir = make_cross_encoder(minilm_dir, tmp_path / "cross")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    pairs = [tok(q, d) for q in QUERIES for d in DOCS]
    ids, types = [p["input_ids"] for p in pairs], [p["token_type_ids"] for p in pairs]
    want = torch.tensor(Encoder(model_dir, torch.float32).encode(ids, types))
    got = torch.tensor(Encoder(model_dir, quantization="w8a8_int8").encode(ids, types))
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 0.05 * want.abs().max() + 0.05, (got, want)


def test_unknown_schemes_and_non_fp32_models_are_refused(minilm_dir):
    from pdserve.shared.encoder import Encoder

    with pytest.raises(ValueError, match="fp8.*not supported.*w8a8_int8"):
        Encoder(minilm_dir, quantization="fp8")
    with pytest.raises(ValueError, match="fp32 model, not bfloat16"):
        Encoder(minilm_dir, torch.bfloat16, quantization="w8a8_int8")
