"""/generate's logprobs in SGLang's meta_info shapes: output_token_logprobs, output_top_logprobs and
output_token_ids_logprobs per output token; their input_ twins per prompt token from logprob_start_len on (the
first prompt token, which nothing predicts, reported as None). Each entry is [logprob, token id, text or None]."""
from __future__ import annotations

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.protocol import per_prompt
from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers.job import Job, TokenLogprob
from pdserve.shared.sampling_params import SamplingParams


def token_ids_logprob(value: object, count: int, batch: bool, vocab_size: int) -> list[tuple[int, ...]]:
    """Each prompt's token_ids_logprob: one flat list of ids for all, or in a batch one list per prompt (SGLang's
    shapes and messages)."""
    if value is None:
        return [()] * count
    flat = "token_ids_logprob must be a flat list of integers."
    if not isinstance(value, list):
        raise ApiError(400, flat, "token_ids_logprob")
    lists = per_prompt(value, count, "token_ids_logprob") if batch and value and isinstance(value[0], list) \
        else [value] * count
    for ids in lists:
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ApiError(400, flat, "token_ids_logprob")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token_ids_logprob contains out-of-vocabulary token id {bad}; valid range is "
                                f"[0, {vocab_size}).", "token_ids_logprob")
    return [tuple(ids) for ids in lists]


def output_logprob_meta(tokenizer: ModelTokenizer, lps: list[TokenLogprob], with_text: bool,
                        params: SamplingParams, next_ids: list[tuple[int, float]] = ()) -> dict:
    """`next_ids`: with max_new_tokens 0, the named ids at the position after the prompt, which SGLang reports as
    the one position of output_token_ids_logprobs (how its score API reads them) though no token is output."""
    def entry(token_id: int, lp: float) -> list:
        return [lp, token_id, tokenizer.token_text(token_id) if with_text else None]

    meta = {"output_token_logprobs": [entry(lp.token_id, lp.logprob) for lp in lps]}
    if params.top_logprobs_num:
        meta["output_top_logprobs"] = [[entry(t, v) for t, v in lp.top] for lp in lps]
    if params.token_ids_logprob:
        meta["output_token_ids_logprobs"] = [[entry(t, v) for t, v in lp.ids] for lp in lps] or \
            ([[entry(t, v) for t, v in next_ids]] if next_ids else [])
    return meta


def prompt_logprob_meta(tokenizer: ModelTokenizer, job: Job, lps: list[TokenLogprob], with_text: bool) -> dict:
    def entry(token_id: int, lp: float | None) -> list:
        return [lp, token_id, tokenizer.token_text(token_id) if with_text else None]

    start, ids = job.params.logprob_start_len, job.input_ids
    tokens = ([entry(ids[0], None)] if start == 0 else []) + [entry(t, lp.logprob)
                                                              for t, lp in zip(ids[max(start, 1):], lps)]
    meta = {"input_token_logprobs": tokens}
    if job.params.top_logprobs_num:
        meta["input_top_logprobs"] = ([None] if start == 0 else []) + [[entry(t, v) for t, v in lp.top]
                                                                        for lp in lps]
    if job.params.token_ids_logprob:
        meta["input_token_ids_logprobs"] = ([None] if start == 0 else []) + [[entry(t, v) for t, v in lp.ids]
                                                                              for lp in lps]
    return meta
