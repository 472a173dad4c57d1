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


def _tiny_decoder_config(kind: str, **extra):
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=2,
                  bos_token_id=1, pad_token_id=2, **extra)
    return tf.Qwen2Config(**common) if kind == "qwen2" else tf.LlamaConfig(**common)


def _spread(model) -> None:
    with torch.no_grad():  # std 0.02 init makes every output near-identical: let each weight matter
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)


def make_tiny_decoder_embedder(out_dir: Path, seed: int = 0) -> Path:
    """A bare 2-layer Qwen2 (saved from Qwen2Model, so without the "model." prefix, as gte-Qwen2-style
    checkpoints are) whose sentence-transformers files ask for last-token pooling and normalisation."""
    import json

    from transformers import Qwen2Model

    from fixtures import make_tiny_tokenizer

    torch.manual_seed(seed)
    model = Qwen2Model(_tiny_decoder_config("qwen2"))
    _spread(model)
    model.eval().save_pretrained(out_dir)
    make_tiny_tokenizer(out_dir)
    (out_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}))
    return out_dir


def make_tiny_reward_model(out_dir: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A 2-layer LlamaForSequenceClassification (the reference's Skywork reward model's architecture)."""
    from transformers import LlamaForSequenceClassification

    from fixtures import make_tiny_tokenizer

    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(_tiny_decoder_config("llama", num_labels=num_labels))
    _spread(model)
    model.eval().save_pretrained(out_dir)
    make_tiny_tokenizer(out_dir)
    return out_dir


def make_tiny_xlm_roberta_reranker(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer XLMRobertaForSequenceClassification with one output (bge-reranker-v2-m3's architecture) and a
    tokenizer with XLM-RoBERTa's conventions: <s>=0, <pad>=1, </s>=2, pairs as `<s> A </s></s> B </s>`, and
    no segment ids. Positions start at pad id + 1, so 258 position rows leave 256 usable tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaForSequenceClassification

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(["what is panda? the giant panda is a bear species endemic to china",
                             "pandas is a python library for data frames. bears eat bamboo. hi"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", mask_token="<mask>", cls_token="<s>", sep_token="</s>",
                                   model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = XLMRobertaConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=258, type_vocab_size=1,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=1)
    model = XLMRobertaForSequenceClassification(config)
    with torch.no_grad():  # as make_tiny_classifier: let every weight matter
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
        gen = torch.Generator().manual_seed(seed)  # a head wide enough for scores to spread past rounding
        model.classifier.dense.weight.copy_(torch.randn(32, 32, generator=gen) * 0.1)
        model.classifier.out_proj.weight.copy_(torch.randn(1, 32, generator=gen) * 0.5)
        model.classifier.out_proj.bias.zero_()
    model.eval().save_pretrained(out_dir)
    return out_dir
