"""Intake: the one step from an API request to the runtime's request, a `Job` (prompt ids, SamplingParams, how
to shape the text), whatever the API's dialect.

Every dialect's handler parses its body (its schema's sampling fields are generated from the dialect's table,
dialects.py), renders and tokenizes its prompt through `Inputs` (inputs.py), then makes one call: `job`, which
reads the sampling fields back through the same table into SamplingParams values (each with the API's name for
it), refuses a length the context cannot hold (SGLang's 400; /v1/responses caps it) and caps an absent one at
what the context leaves, adds a tool choice's grammar and the reasoning span, builds and
validates the SamplingParams (a bad value is a 400 naming the field as the API spells it) and compiles its
grammar, once each. The worker validates again at its own edge; nothing in between does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.constraints import (SGLANG_CONSTRAINTS, after_reasoning, constraint_values,
                                                         logit_bias_values)
from pdserve.services.gateway.intake.dialects import OPENAI_CHAT, OPENAI_RESPONSES, Dialect
from pdserve.services.gateway.intake.inputs import Inputs
from pdserve.services.gateway.intake.protocol import ResponseFormat
from pdserve.services.gateway.intake.tool_calls import ToolPlan
from pdserve.services.gateway.workers.job import Job
from pdserve.services.gateway.workers.stops import compile_stop_regex
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
        values.update(top_logprobs_num=0, logprob_start_len=-1, token_ids_logprob=())
    return Draft(values, {**dialect.renamed, **names}, prefix)


def build_params(draft: Draft, vocab_size: int | None, params: type = SamplingParams) -> SamplingParams:
    """The checked SamplingParams; a bad value is a 400 naming the field as the API calls it. A stop token id past
    the vocabulary is dropped, not refused: no step can sample it, and SGLang serves such a list (one written for
    a model with a larger vocabulary)."""
    stops = draft.values.get("stop_token_ids")
    if vocab_size is not None and stops:
        draft.values["stop_token_ids"] = tuple(
            t for t in stops if not (isinstance(t, int) and not isinstance(t, bool) and t >= vocab_size))
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


def check_room(dialect: Dialect, draft: Draft, asked: object, prompt_tokens: int, context: int) -> None:
    """SGLang's 400 for a length the context cannot hold, in its words (a client may match on them): more than
    the whole context, or more than the prompt leaves of it. /v1/responses caps it instead, as SGLang does."""
    if dialect.name == OPENAI_RESPONSES.name or not isinstance(asked, int) or isinstance(asked, bool) or asked < 0:
        return
    param = draft.api_name("max_new_tokens")
    name = "max_completion_tokens" if dialect.name == OPENAI_CHAT.name else param.rpartition(".")[2]
    if asked > context:
        raise ApiError(400, f"{name} is too large: {asked}. This model supports at most {context} completion "
                            "tokens.", param)
    if prompt_tokens + asked > context:
        raise ApiError(400, f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                            f"You requested a total of {prompt_tokens + asked} tokens: {prompt_tokens} tokens from "
                            f"the input messages and {asked} tokens for the completion. Please reduce the number of "
                            "tokens in the input messages or the completion to fit within the limit.", param)


async def job(inputs: Inputs, dialect: Dialect, fields: BaseModel, ids: list[int], *, rid: str,
              lora: str | None, max_tokens: int | None, public_id: str = "", prefix: str = "",
              response_format: ResponseFormat | None = None, tools: ToolPlan | None = None,
              reasoning_parser: str | None = None, renamed: dict[str, str] | None = None, **elsewhere: Any) -> Job:
    """The runtime's request for one prompt of `ids`. `fields`: the model that holds the dialect's sampling
    fields and the text options (stop strings, special tokens, trimming): the request, or native's
    `sampling_params` (at `prefix` in the body). `max_tokens`: what the client asked (None: as many as the
    context leaves; more than it leaves is a 400, see `check_room`). `tools`: the request's tool plan (its grammar, and
    whether its output needs special tokens); `reasoning_parser`: the parser whose reasoning span the grammar
    starts after; `renamed`: runtime field -> the API's name, where this request spelt it otherwise;
    `elsewhere`: the fields the dialect carries outside its sampling fields (logprobs)."""
    draft = read(dialect, fields, prefix=prefix, response_format=response_format, **elsewhere)
    draft.names.update(renamed or {})
    check_room(dialect, draft, max_tokens, len(ids), inputs.context_length())
    draft.values["max_new_tokens"] = inputs.limits.new_tokens(max_tokens, len(ids), inputs.context_length())
    if tools is not None:
        draft.values, draft.names = tools.constrain(draft.values, draft.names)
    draft.values = after_reasoning(draft.values, reasoning_parser, inputs.tokenizer)
    params = build_params(draft, inputs.tokenizer.vocab_size)
    await inputs.check_constraint(params, draft.names, draft.prefix)
    skip = fields.skip_special_tokens and not (tools is not None and tools.needs_special_tokens)
    spaces = getattr(fields, "spaces_between_special_tokens", True)  # native only; OpenAI's text always has them
    return Job(rid, ids, params, fields.stop_list(), skip, fields.no_stop_trim, spaces, lora=lora,
               public_id=public_id, stop_regex=stop_regexes(fields, prefix))


def stop_regexes(fields: BaseModel, prefix: str) -> list[str]:
    """The request's stop_regex patterns (a string or a list), each compiled once here: a bad one is a 400."""
    value = getattr(fields, "stop_regex", None)
    patterns = [value] if isinstance(value, str) else list(value or [])
    for k, pattern in enumerate(patterns):
        try:
            compile_stop_regex(pattern)
        except ValueError as exc:
            name = prefix + "stop_regex" + ("" if isinstance(value, str) else f".{k}")
            raise ApiError(400, f"Invalid value for {name!r}: {exc}", name) from None
    return patterns
