"""What a request asks of its output beyond sampling: a grammar constraint, and biases on token logits.

The APIs spell these several ways (OpenAI's `response_format` and `logit_bias`; SGLang's `regex`, `ebnf`,
`json_schema` and `structural_tag`, top level on its OpenAI routes and inside native `sampling_params`). Here
they become the runtime's SamplingParams values, each with the API name to blame when it is bad; the grammar
itself is then compiled once by `Inputs.check_constraint`, so an invalid one is a 400 before any worker runs.
"""
from __future__ import annotations

import json

from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.protocol import ResponseFormat
from pdserve.services.gateway.intake.reasoning import PARSERS

# OpenAI's json_object: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
SGLANG_CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")


def after_reasoning(values: dict, parser: str | None, tokenizer) -> dict:
    """With a reasoning parser, a grammar holds for the answer after the reasoning, not for the reasoning."""
    if parser is None or not any(values.get(name) is not None for name in SGLANG_CONSTRAINTS):
        return values
    fmt = PARSERS[parser]
    start = () if fmt.forced else tuple(tokenizer.encode(fmt.start, add_special_tokens=False))
    return dict(values, think_start_ids=start, think_end_ids=tuple(tokenizer.encode(fmt.end, add_special_tokens=False)))


def constraint_values(response_format: ResponseFormat | None, fields: dict, prefix: str = "") -> tuple[dict, dict]:
    """(SamplingParams values, {SamplingParams field: API name}) of a request's constraint.

    `fields` holds SGLang's constraint fields as the request gave them (None when absent); `prefix` is where
    they sit in the request body (native: "sampling_params."). At most one constraint may be given, counting
    response_format.
    """
    given: list[tuple[str, str, str]] = []  # (runtime field, text, API name)
    if response_format is not None and response_format.type != "text":
        given.append(_response_format(response_format))
    for name in SGLANG_CONSTRAINTS:
        value = fields.get(name)
        if value is not None:
            given.append((name, value, name))
    if len(given) > 1:
        first, second = prefix + given[0][2], prefix + given[1][2]
        raise ApiError(400, f"Give at most one of response_format, regex, ebnf, json_schema and structural_tag; "
                            f"got {first!r} and {second!r}.", second)
    if not given:
        return {}, {}
    field, text, api_name = given[0]
    return {field: text}, {field: api_name}


def _response_format(rf: ResponseFormat) -> tuple[str, str, str]:
    if rf.type == "json_object":
        return "json_schema", JSON_OBJECT_SCHEMA, "response_format"
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(400, "response_format of type 'json_schema' needs json_schema.schema.",
                           "response_format.json_schema.schema")
        return "json_schema", json.dumps(rf.json_schema.schema_), "response_format.json_schema.schema"
    tag = rf.model_dump(exclude_none=True, by_alias=True)
    if rf.structures is None and rf.format is None:
        raise ApiError(400, "response_format of type 'structural_tag' needs 'structures' and 'triggers' "
                            "(or a 'format').", "response_format.structures")
    return "structural_tag", json.dumps(tag), "response_format"


def logit_bias_values(bias: dict[str, float] | None, name: str = "logit_bias") -> dict:
    """SamplingParams' logit_bias from the API's {"token id": bias}; ranges are checked by SamplingParams."""
    if not bias:
        return {}
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"Invalid value for {name!r}: keys must be token ids, got {key!r}.", name) from None
        out[token] = value
    return {"logit_bias": out}
