"""Prefill-only scoring on the generative runtime: next-token log-probabilities of chosen label tokens.

Lifecycle of one group of sequences, all inside the engine thread (handed over with `Engine.call`, so the
scheduler, pool and cache keep a single owner): match each sequence's prefix in the radix cache -> take
pages for the rest -> one prefill forward -> log-softmax of each last row, read at the label ids ->
hand the full pages to the radix cache and free the rest. Nothing is sampled, nothing is transferred and
no page outlives the call, so the pool's integrity check holds between any two engine steps.

A request with many items is cut into groups of at most one prefill chunk of tokens (`step_budget`: the
scheduler's --chunked-prefill-size, as a generation's prompt is cut; `plan_groups`); the caller submits one
group per call, so running generations get decode steps in between. A sequence longer than a chunk is
computed chunk by chunk (`prefill_prefix`, one call each): each chunk's full pages go to the radix cache, and
the next call starts from them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.shared.req import Req
from pdserve.shared.sampling_params import MAX_SCORE_LABELS, MAX_SCORE_VALUES, SamplingParams
from pdserve.shared.scheduler import Batch

_NO_SAMPLING = SamplingParams(max_new_tokens=0)


@dataclass(frozen=True)
class DecoderPooling:
    """How a pooling decoder's output is served: an embedding (last token, maybe L2-normalised) or the raw
    scores of a sequence classifier."""

    kind: str  # "an embedding model" or "a classification model", for messages
    normalize: bool

    @classmethod
    def for_model(cls, model_dir: str, is_classifier: bool) -> DecoderPooling:
        if is_classifier:
            return cls("a classification model", False)
        from pathlib import Path

        from pdserve.shared.pooling import PoolingConfig

        # Decoder embedding checkpoints (gte-Qwen2 and the like) pool the last token and normalise; a
        # sentence-transformers modules.json may say so, or say otherwise.
        if not (Path(model_dir) / "modules.json").exists():
            return cls("an embedding model", True)
        config = PoolingConfig.from_dir(model_dir)
        if config.mode != "last":
            raise ValueError(f"{model_dir}: {config.mode} pooling of a decoder is not supported (a causal "
                             "model's embedding is its last token's hidden state: pooling_mode_lasttoken)")
        return cls("an embedding model", config.normalize)


class PoolBusy(RuntimeError):
    """The KV pool has no room for the group now (running generations hold it); retry later."""


@dataclass
class ScoreResult:
    logprobs: list[list[float]]  # [sequence][label], natural log
    prompt_tokens: int
    cached_tokens: int


def step_budget(scheduler_config) -> int:
    """New tokens one scoring call may compute: what one prefill step of a generation computes at most."""
    chunk = scheduler_config.chunked_prefill_size
    budget = scheduler_config.max_prefill_tokens
    return min(budget, chunk) if chunk > 0 else budget


def plan_groups(lengths: list[int], max_tokens: int) -> list[range]:
    """Consecutive groups of sequence indices holding at most `max_tokens` tokens (a longer one goes alone)."""
    groups, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > max_tokens:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


def check_inputs(seqs: list[list[int]], label_ids: list[int], vocab_size: int, context_length: int) -> None:
    """ValueError for inputs the runtime cannot score (the gateway checks the same, in the API's words)."""
    if not label_ids:
        raise ValueError("label_token_ids is empty")
    if len(label_ids) > MAX_SCORE_LABELS:
        raise ValueError(f"label_token_ids holds {len(label_ids)} ids, more than the limit of {MAX_SCORE_LABELS}")
    if len(seqs) * len(label_ids) > MAX_SCORE_VALUES:
        raise ValueError(f"{len(seqs)} items x {len(label_ids)} labels is more than the limit of {MAX_SCORE_VALUES} "
                         "scores per call")
    bad = next((t for t in label_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"label token id {bad} is outside the vocabulary (size {vocab_size})")
    check_sequences(seqs, vocab_size, context_length)


def check_sequences(seqs: list[list[int]], vocab_size: int, context_length: int) -> None:
    """ValueError for token sequences the runtime cannot prefill."""
    if not seqs:
        raise ValueError("no input to score")
    for seq in seqs:
        if not seq:
            raise ValueError("an input is empty")
        if len(seq) > context_length:
            raise ValueError(f"an input has {len(seq)} tokens, more than the context length of {context_length}")
        bad = next((t for t in seq if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")


def score_group(engine, seqs: list[list[int]], label_ids: list[int]) -> ScoreResult:
    """Engine thread only. Log-probabilities of `label_ids` after each sequence of `seqs`."""
    logits, cached = _last_rows(engine, seqs)  # [B, V]
    labels = torch.tensor(label_ids, dtype=torch.int64, device=logits.device)
    # Normalise over the whole vocabulary in fp32: a label's probability is what sampling would give it.
    logprobs = torch.log_softmax(logits.float(), dim=-1).index_select(1, labels)  # [B, L]
    return ScoreResult(logprobs.tolist(), sum(len(s) for s in seqs), cached)


def pool_group(engine, seqs: list[list[int]], normalize: bool) -> ScoreResult:
    """Engine thread only. A pooling decoder's output for each sequence of `seqs`: its last token's final
    hidden state (an embedding, L2-normalised when `normalize`) or a classifier's scores."""
    out, cached = _last_rows(engine, seqs)  # [B, H] or [B, labels]
    out = out.float()
    if normalize:
        out = torch.nn.functional.normalize(out, dim=-1)
    return ScoreResult(out.tolist(), sum(len(s) for s in seqs), cached)


def prefill_prefix(engine, seq: list[int]) -> None:
    """Engine thread only. Compute `seq` into the radix cache, reading no output: one chunk of a sequence
    longer than a step's budget, so that the call that scores it computes only what is left."""
    _last_rows(engine, [seq])


def _last_rows(engine, seqs: list[list[int]]) -> tuple[torch.Tensor, int]:
    """One prefill forward of `seqs` on the paged runtime: the model's output at each last token, and the
    prompt tokens read from the prefix cache. No page outlives the call (full ones stay cached)."""
    scheduler, runner = engine.scheduler, engine.runner
    reqs = [Req(rid="score", input_ids=list(seq), params=_NO_SAMPLING) for seq in seqs]
    admitted: list[Req] = []
    try:
        for req in reqs:
            _match_prefix(scheduler, req)
            admitted.append(req)
            if not scheduler.grow(req, req.seq_len):
                raise PoolBusy(f"the KV pool has no room for {req.seq_len} more tokens now; retry later")
        batch = Batch(reqs, is_decode=False, extend_lens=[r.seq_len - r.num_computed for r in reqs])
        out = runner.forward(batch)  # [B, V]
        for req, n in zip(reqs, batch.extend_lens):
            req.num_computed += n
        return out, sum(r.cached_tokens for r in reqs)
    finally:
        for req in admitted:
            scheduler.release(req, cache=True)


def _match_prefix(scheduler, req: Req) -> None:
    """Reuse cached pages of the prompt's prefix, leaving at least one token to compute (its logits)."""
    page_size = scheduler.page_size
    match = scheduler.cache.match_prefix(req.input_ids, max_pages=(req.seq_len - 1) // page_size)
    scheduler.cache.lock(match.node)
    req.prefix_node = match.node
    req.pages = list(match.pages)
    req.num_cached_pages = len(match.pages)
    req.num_computed = req.cached_tokens = len(match.pages) * page_size
