"""Intake: the one step from an API request to the runtime's request, a `Job` (prompt ids, SamplingParams, how
to shape the text), whatever the API's dialect.

Every handler takes the same path: `read` the request's sampling fields back through its dialect's table
(dialects.py) into SamplingParams values, each with the API's name for it -> the handler's additions (the max
tokens the context leaves, a tool choice's grammar, the reasoning span) -> `job`, which builds the SamplingParams,
validates it (a bad value is a 400 naming the field as the API spells it) and compiles its grammar, once each.
The worker validates again at its own edge; nothing in between does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pdserve.services.gateway.constraints import SGLANG_CONSTRAINTS, constraint_values, logit_bias_values
from pdserve.services.gateway.context import Gateway
from pdserve.services.gateway.dialects import Dialect
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.generation import Job
from pdserve.services.gateway.protocol import ResponseFormat
from pdserve.shared.sampling_params import InvalidParam, SamplingParams


@dataclass
class Draft:
    """The SamplingParams values of one prompt, not yet checked."""

    values: dict[str, Any]  # SamplingParams field -> value (None: the runtime's default)
    names: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> the API's name, where they differ
    prefix: str = ""  # where the sampling fields sit in the body ("sampling_params.", "sampling_params.2.")

    def api_name(self, name: str) -> str:
        return self.prefix + self.names.get(name, name)


def read(dialect: Dialect, sampling: BaseModel, *, prefix: str = "", response_format: ResponseFormat | None = None,
         params: type = SamplingParams, **elsewhere: Any) -> Draft:
    """The values of `sampling` (a model with the dialect's generated fields) under their runtime names, with
    `elsewhere`: the fields the dialect carries outside its sampling fields (max tokens, logprobs)."""
    values = {f.name: getattr(sampling, dialect.api_name(f.name)) for f in dialect.carried(params)}
    bias = logit_bias_values(values.pop("logit_bias"), prefix + dialect.api_name("logit_bias"))
    constraint, names = constraint_values(response_format, {k: values.pop(k) for k in SGLANG_CONSTRAINTS}, prefix)
    for f in dialect.carried(params):
        if f.name in values and isinstance(f.default, tuple):  # token lists: null or absent is the empty list
            values[f.name] = tuple(values[f.name] or ())
    values.update(constraint, **bias, logprob_start_len=-1)  # no prompt logprobs unless the API asks for them
    values.update(elsewhere)
    if not values.get("return_logprob"):  # logprob details mean nothing without logprobs
        values.update(top_logprobs_num=0, logprob_start_len=-1)
    return Draft(values, {**dialect.renamed, **names}, prefix)


def build_params(draft: Draft, vocab_size: int | None, params: type = SamplingParams) -> SamplingParams:
    """The checked SamplingParams; a bad value is a 400 naming the field as the API calls it."""
    try:
        built = params(**{k: v for k, v in draft.values.items() if v is not None})
        built.validate(vocab_size)
    except InvalidParam as exc:
        message = str(exc)
        for internal, external in draft.names.items():  # speak the API's field names, not the runtime's
            message = message.replace(internal, external)
        name = draft.api_name(exc.field)
        raise ApiError(400, f"Invalid value for {name!r}: {message}", name) from None
    return built


async def job(gw: Gateway, draft: Draft, text: BaseModel, rid: str, input_ids: list[int], *, lora: str | None,
              public_id: str = "", skip_special_tokens: bool | None = None) -> Job:
    """The runtime's request for one prompt: `draft` built and checked (its grammar compiled), and the text options
    of `text` (the request's stop strings, special tokens, trimming)."""
    params = build_params(draft, gw.tokenizer.vocab_size)
    await gw.check_constraint(params, draft.names, draft.prefix)
    skip = text.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
    spaces = getattr(text, "spaces_between_special_tokens", True)  # native only; OpenAI's text always has them
    return Job(rid, input_ids, params, text.stop_list(), skip, text.no_stop_trim, spaces, lora=lora,
               public_id=public_id)
