"""The Encoder's classification path (cross-encoder pairs with segment ids, multi-label heads) against
transformers' BertForSequenceClassification on the same checkpoints."""
from __future__ import annotations

import pytest
import torch

QUERY = "what is panda?"
DOCS = ["hi", "The giant panda (Ailuropoda melanoleuca) is a bear species endemic to China.",
        "pandas is a Python library for data frames"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_dir):
    from pooling_models import make_cross_encoder, make_tiny_classifier, make_tiny_xlm_roberta_reranker

    minilm = minilm_dir
    root = tmp_path_factory.mktemp("classifiers")
    return {"cross": make_cross_encoder(minilm, root / "cross"), "tiny": make_tiny_classifier(minilm, root / "tiny"),
            "xlm-roberta": make_tiny_xlm_roberta_reranker(root / "xlm-roberta")}


def reference(model_dir, first: list[str], second: list[str] | None) -> tuple[torch.Tensor, list[dict]]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**tok(first, second, padding=True, return_tensors="pt")).logits
    pairs = [tok(a, b) if second else tok(a) for a, b in zip(first, second or first)]
    return logits, pairs


@pytest.mark.parametrize("name", ["cross", "tiny"])
def test_pairs_with_segment_ids_match_transformers(models, name):
    from pdserve.shared.encoder import Encoder

    encoder = Encoder(models[name])
    want, pairs = reference(models[name], [QUERY] * len(DOCS), DOCS)
    assert encoder.is_classifier and encoder.output_dim == want.shape[1]
    got = torch.tensor(encoder.encode([p["input_ids"] for p in pairs], [p["token_type_ids"] for p in pairs]))
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    # Without the segment ids the document reads as part of the query: a different answer.
    blind = torch.tensor(encoder.encode([p["input_ids"] for p in pairs]))
    assert (blind - want).abs().max() > 1e-3


def test_xlm_roberta_rerankers_match_transformers(models):
    from pdserve.shared.encoder import Encoder

    model_dir = models["xlm-roberta"]
    encoder = Encoder(model_dir)
    # Its 258 position rows start after the padding id (1): 256 usable tokens.
    assert encoder.is_classifier and encoder.output_dim == 1 and encoder.context_length == 256
    want, pairs = reference(model_dir, [QUERY] * len(DOCS), DOCS)
    assert "token_type_ids" not in pairs[0]  # XLM-RoBERTa has one segment: its tokenizer gives none
    assert pairs[1]["input_ids"].count(2) == 3  # <s> query </s></s> document </s>
    got = torch.tensor(encoder.encode([p["input_ids"] for p in pairs]))  # padded to the longest, with <pad>
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    alone = torch.tensor(encoder.encode([pairs[0]["input_ids"]]))
    assert torch.allclose(alone[0], got[0], atol=1e-5)
    with pytest.raises(ValueError, match="context length"):
        encoder.submit([[0] + [5] * 255 + [2]])


def test_classifiers_keep_fp32_matmuls_where_embeddings_would_not(models, monkeypatch):
    from pdserve.shared import linear
    from pdserve.shared.encoder import Encoder

    # On a CPU whose bf16 matmuls pay (AMX), an fp32 embedding model multiplies in bf16 (tests/shared/test_bert.py);
    # a classifier's scores are read as numbers, so it stays in fp32 and still matches transformers to 1e-4.
    monkeypatch.setattr(linear, "_bf16_matmul", True)
    encoder = Encoder(models["cross"])
    assert encoder.matmul_dtype == torch.float32
    want, pairs = reference(models["cross"], [QUERY] * len(DOCS), DOCS)
    got = torch.tensor(encoder.encode([p["input_ids"] for p in pairs], [p["token_type_ids"] for p in pairs]))
    assert torch.allclose(got, want, atol=1e-4), (got, want)


def test_single_texts_get_every_label(models):
    from pdserve.shared.encoder import Encoder

    want, singles = reference(models["tiny"], DOCS, None)
    got = torch.tensor(Encoder(models["tiny"]).encode([s["input_ids"] for s in singles]))
    assert got.shape == (3, 3) and torch.allclose(got, want, atol=1e-4)


def test_bad_segment_ids_are_refused(models):
    from pdserve.shared.encoder import Encoder

    encoder = Encoder(models["tiny"])
    with pytest.raises(ValueError, match="one segment id per token"):
        encoder.submit([[101, 102]], [[0]])
    with pytest.raises(ValueError, match="segment ids"):
        encoder.submit([[101, 102]], [[0, 2]])
