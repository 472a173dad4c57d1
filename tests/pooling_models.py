"""Sequence-classification checkpoints for the pooling tests, made offline from all-MiniLM-L6-v2's files.

- `make_cross_encoder`: the real MiniLM encoder with a seeded classification head (and pooler), one output:
  a reranker whose scores spread enough for the ranking to mean something.
- `make_tiny_classifier`: a 2-layer, hidden-32 random BERT with three labels, sharing MiniLM's tokenizer.
Both save HF safetensors and the tokenizer, so transformers and pdserve load the same directory.
"""
from __future__ import annotations

from pathlib import Path

import torch


def _boost_head(model, seed: int) -> None:
    # transformers initialises heads with std 0.02: logits near 0 would make every score ~0.5.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (model.classifier.weight, model.classifier.bias):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def make_cross_encoder(minilm_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the new head's "newly initialized" warning is the point here
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(str(minilm_dir), num_labels=1, dtype=torch.float32)
    _boost_head(model, seed)
    model.eval().save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(out_dir)
    return out_dir


def make_tiny_classifier(minilm_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, id2label=labels,
                        label2id={v: k for k, v in labels.items()})
    model = BertForSequenceClassification(config)
    with torch.no_grad():  # random init is near-trivial (LayerNorms at 1/0, std 0.02): make every weight matter
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
    _boost_head(model, seed)
    model.eval().save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(out_dir)
    return out_dir
