"""How each API spells the runtime's sampling parameters: one table per dialect, and the fields built from it.

SamplingParams (shared/sampling_params.py) is the one definition of a sampling parameter. A dialect says only
where an API differs from it: the API's name for a field, the fields the request carries elsewhere (request-level
fields, or values the gateway derives), and the fields that may be null. `sampling_fields` builds the pydantic
fields of the dialect's schema (protocol.py) from the dataclass, defaults included, so a parameter added to
SamplingParams reaches every API with no edit here; `intake` reads a request back through the same table.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from pdserve.shared.sampling_params import SamplingParams

# Fields no API sets: the gateway derives them (from its reasoning parser, constraints.after_reasoning).
GATEWAY_DERIVED = frozenset({"think_start_ids", "think_end_ids"})
# Logprob fields that every API asks for beside its sampling fields (OpenAI's logprobs, SGLang's return_logprob).
LOGPROB_FIELDS = frozenset({"return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob"})


@dataclass(frozen=True)
class Dialect:
    name: str
    renamed: Mapping[str, str] = field(default_factory=dict)
    """SamplingParams field -> the API's name for it, where the two differ."""
    elsewhere: frozenset[str] = LOGPROB_FIELDS | GATEWAY_DERIVED
    """Fields that are not among the API's sampling fields: the handler passes them to the intake."""
    nullable: frozenset[str] = frozenset()
    """Fields the API also accepts as null."""
    null_by_default: bool = False
    """Whether a nullable field defaults to null, which stands for the runtime's default (OpenAI's habit)."""

    def api_name(self, name: str) -> str:
        return self.renamed.get(name, name)

    def carried(self, params: type = SamplingParams) -> list[dataclasses.Field]:
        """The SamplingParams fields among this API's sampling fields, in the dataclass's order."""
        return [f for f in dataclasses.fields(params) if f.name not in self.elsewhere]


OPENAI_CHAT = Dialect(
    "openai-chat",
    renamed={"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs_num": "top_logprobs",
             "return_logprob": "logprobs"},
    elsewhere=LOGPROB_FIELDS | GATEWAY_DERIVED | {"max_new_tokens"},  # max_tokens or max_completion_tokens
    # OpenAI clients send null for "the server's default"; the rest have been non-null since they were added.
    nullable=frozenset({"temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                        "repetition_penalty"}),
    null_by_default=True)
# /v1/completions carries the same sampling fields as chat; only its logprobs field is spelled otherwise.
OPENAI_COMPLETION = dataclasses.replace(OPENAI_CHAT, name="openai-completion",
                                        renamed={**OPENAI_CHAT.renamed, "top_logprobs_num": "logprobs"})
# /v1/responses: chat's sampling fields (SGLang's extensions included), the length named max_output_tokens and null
# by default (as many as the context leaves); no n (a response has one output), logprobs through top_logprobs.
OPENAI_RESPONSES = dataclasses.replace(
    OPENAI_CHAT, name="openai-responses", renamed={**OPENAI_CHAT.renamed, "max_new_tokens": "max_output_tokens"},
    elsewhere=LOGPROB_FIELDS | GATEWAY_DERIVED | {"n"}, nullable=OPENAI_CHAT.nullable | {"max_new_tokens"})
# Anthropic's /v1/messages: max_tokens is required and read beside the sampling fields; one message per request
# (no n), no logprobs. The SamplingParams fields it does not name stay available as extensions, as on chat.
ANTHROPIC_MESSAGES = Dialect(
    "anthropic-messages",
    renamed={"max_new_tokens": "max_tokens"},
    elsewhere=LOGPROB_FIELDS | GATEWAY_DERIVED | {"max_new_tokens", "n"},
    nullable=frozenset({"temperature", "top_p", "top_k"}))
# /generate: cache_salt beside the prompts, as lora_path and rid (it names whose cache, not how to sample).
NATIVE = Dialect(
    "native",
    renamed={"seed": "sampling_seed"},
    elsewhere=LOGPROB_FIELDS | GATEWAY_DERIVED | {"cache_salt"},
    nullable=frozenset({"max_new_tokens"}))  # null: as many as the context leaves


def sampling_fields(dialect: Dialect, params: type = SamplingParams) -> dict[str, tuple[Any, Any]]:
    """{API name: (annotation, default)} of the dialect's sampling fields, for `pydantic.create_model`."""
    hints = typing.get_type_hints(params)
    out = {}
    for f in dialect.carried(params):
        annotation, default = _api_type(hints[f.name]), f.default
        if typing.get_origin(hints[f.name]) is tuple:
            default = None  # an absent list means the empty one
        if f.name in dialect.nullable:
            annotation = annotation | None
            default = None if dialect.null_by_default else default
        out[dialect.api_name(f.name)] = (annotation, default)
    return out


def _api_type(hint: Any) -> Any:
    """The JSON shape of a SamplingParams type: token lists as lists, (token, bias) pairs as an object."""
    if typing.get_origin(hint) is not tuple:
        return hint
    item = typing.get_args(hint)[0]
    if typing.get_origin(item) is tuple:  # ((key, value), ...): JSON object keys are strings
        return dict[str, typing.get_args(item)[1]] | None
    return list[item] | None
