"""Response bodies of the OpenAI-compatible endpoints, in the shape SGLang returns them."""
from __future__ import annotations

from pdserve.services.gateway.tokenization import ModelTokenizer
from pdserve.services.gateway.workers.job import ChoiceResult, TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None,
          reasoning_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
            "reasoning_tokens": reasoning_tokens}


# ---------------------------------------------------------------- logprobs
def chat_logprobs(tok: ModelTokenizer, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tok.token_text(token_id), "logprob": logprob, "bytes": tok.token_bytes(token_id)}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


def completion_logprobs(tok: ModelTokenizer, lps: list[TokenLogprob], offset: int, with_top: bool) -> dict:
    tokens, offsets = [], []
    for lp in lps:
        text = tok.token_text(lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [{tok.token_text(t): v for t, v in lp.top} for lp in lps] if with_top else None
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def prompt_completion_logprobs(tok: ModelTokenizer, ids: list[int], lps: list[TokenLogprob], with_top: bool) -> dict:
    """The echoed prompt's part of a completion's logprobs: its first token, which nothing predicts, has None."""
    tokens, offsets, offset = [], [], 0
    for token_id in ids:
        text = tok.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [None] + [{tok.token_text(t): v for t, v in lp.top} for lp in lps] if with_top else None
    return {"tokens": tokens, "token_logprobs": [None] + [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def join_logprobs(first: dict, then: dict | None) -> dict:
    if then is None:
        return first
    top = first["top_logprobs"] + then["top_logprobs"] if first["top_logprobs"] is not None else None
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "text_offset")} | {"top_logprobs": top}


# ---------------------------------------------------------------- chat
def chat_message(content: str | None, reasoning: str | None, tool_calls: list[dict] | None = None) -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


def chat_choice(r: ChoiceResult, content: str | None, reasoning: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None, finish: tuple[str | None, int | str | None] | None = None
                ) -> dict:
    """`finish`: (finish_reason, matched_stop) when tool calls changed them (tool_calls.CallStream)."""
    finish_reason, matched_stop = finish or (r.finish_reason, r.matched_stop)
    return {"index": r.index, "message": chat_message(content, reasoning, tool_calls), "logprobs": logprobs,
            "finish_reason": finish_reason, "matched_stop": matched_stop}


def chat_completion(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_}


def chat_chunk(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, "usage": usage_}


DELTA_FIELDS = ("content", "reasoning_content", "tool_calls")


def chunk_choice(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
                 matched_stop: int | str | None = None) -> dict:
    """`delta`: what the chunk brings; the delta fields it does not bring are null, as SGLang sends them, so a
    client reading one finds it (the openai SDK's ChoiceDelta does not declare `reasoning_content`: read on a
    chunk without the key, it raises AttributeError). The role is sent once, on each choice's first chunk."""
    return {"index": index, "delta": {**delta, **{name: delta.get(name) for name in DELTA_FIELDS}},
            "logprobs": logprobs, "finish_reason": finish_reason, "matched_stop": matched_stop}


# ---------------------------------------------------------------- completions
def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      matched_stop: int | str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "matched_stop": matched_stop}


def completion(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_}


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdserve", "root": name,
            "parent": None, "max_model_len": max_model_len}
