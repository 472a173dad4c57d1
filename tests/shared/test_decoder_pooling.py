"""Pooling decoders on the paged runtime: embeddings from a bare decoder's last token and reward-model scores,
against transformers on the same tiny random weights (fp32)."""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, ModelConfig, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.scoring import DecoderPooling, pool_group
from pooling_models import make_tiny_decoder_embedder, make_tiny_reward_model

SEQS = [[5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 9, 11, 13, 15, 17, 19, 21], [100, 101, 102], [5, 17, 99, 3, 250]]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return make_tiny_decoder_embedder(tmp_path_factory.mktemp("decoder-embedder"))


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("reward-model"), num_labels=2)


def engine_for(model_dir, **kw) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32", **kw))


def test_bare_decoder_embeddings_match_transformers_and_reuse_the_prefix_cache(embedder):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(embedder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([torch.nn.functional.normalize(hf(torch.tensor([s])).last_hidden_state[0, -1], dim=-1)
                            for s in SEQS])
    engine = engine_for(embedder, cache=CacheConfig(page_size=4, max_total_tokens=1024))
    assert ModelConfig.from_dir(embedder).is_bare and not engine.generates
    pooling = DecoderPooling.for_model(str(embedder), is_classifier=False)
    assert pooling.normalize
    first = pool_group(engine, SEQS, pooling.normalize)
    again = pool_group(engine, SEQS, pooling.normalize)  # the prompts' full pages now come from the cache
    assert again.cached_tokens > 0
    for result in (first, again):
        got = torch.tensor(result.logprobs)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(SEQS)), atol=1e-5)
    assert engine.scheduler.check_integrity().ok and engine.scheduler.check_integrity().held == 0


def test_sequence_classifier_scores_match_transformers(reward_model):
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([s])).logits for s in SEQS])  # [B, 2]
    engine = engine_for(reward_model)  # a classifier needs no --is-embedding
    assert ModelConfig.from_dir(reward_model).num_labels == 2 and not engine.generates
    pooling = DecoderPooling.for_model(str(reward_model), is_classifier=True)
    got = torch.tensor(pool_group(engine, SEQS, pooling.normalize).logprobs)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_decoder_pooling_other_than_last_token_is_refused(embedder, tmp_path):
    import json
    import shutil

    copy = shutil.copytree(embedder, tmp_path / "mean")
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="mean pooling of a decoder is not supported"):
        DecoderPooling.for_model(str(copy), is_classifier=False)
