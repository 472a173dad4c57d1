"""A request parameter has one definition (shared/sampling_params.py); the wire format and the APIs must agree
with it. Each test here fails when a parameter is added in one place and forgotten in another."""
from __future__ import annotations

import ast
import dataclasses
import typing
from dataclasses import fields
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor
from pydantic import create_model

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway import intake
from pdserve.services.gateway.intake.dialects import (GATEWAY_DERIVED, NATIVE, OPENAI_CHAT, OPENAI_COMPLETION, Dialect,
                                               sampling_fields)
from pdserve.services.gateway.intake.protocol import ChatCompletionRequest, CompletionRequest, NativeSampling
from pdserve.shared import sampling_params
from pdserve.shared.sampling_params import CONSTRAINT_FIELDS, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PARAMS = {f.name: f for f in fields(SamplingParams)}
PROTO = pb.SamplingParams.DESCRIPTOR.fields_by_name
HINTS = typing.get_type_hints(SamplingParams)
# Which proto field types carry which Python type of the dataclass.
WIRE_TYPES = {float: {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE},
              int: {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64},
              bool: {FieldDescriptor.TYPE_BOOL}, str: {FieldDescriptor.TYPE_STRING}}


def test_the_wire_message_has_exactly_the_runtime_fields():
    assert set(PROTO) == set(PARAMS)


def test_each_wire_field_carries_the_runtime_type():
    for name, hint in HINTS.items():
        field = PROTO[name]
        optional = type(None) in typing.get_args(hint)
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
        if typing.get_origin(base) is tuple:
            assert field.is_repeated, name  # a list (repeated) or a mapping (map<k, v>)
            continue
        assert field.type in WIRE_TYPES[base], name
        assert field.has_presence == optional, f"{name}: optional in one definition only"


def test_the_runtime_library_does_not_import_the_wire_format():
    for path in (ROOT / "shared").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any("proto" in n for n in names), f"{path.relative_to(ROOT)} imports {names}"
    assert "worker_pb2" not in Path(sampling_params.__file__).read_text()


def test_native_sampling_params_carry_every_runtime_field():
    missing = {NATIVE.api_name(n) for n in PARAMS} - set(NativeSampling.model_fields) \
        - {"return_logprob", "top_logprobs_num", "logprob_start_len"} - set(GATEWAY_DERIVED)  # request-level
    assert not missing
    draft = intake.read(NATIVE, NativeSampling(logit_bias={"1": 2.0}, regex="a", max_new_tokens=8),
                        return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    values = draft.values
    assert set(values) == set(PARAMS) - (set(CONSTRAINT_FIELDS) - {"regex"}) - set(GATEWAY_DERIVED)
    SamplingParams(**values).validate()


def test_openai_requests_reach_every_runtime_field():
    reached = set()
    for constraint in CONSTRAINT_FIELDS:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                    "logit_bias": {"3": 1}, constraint: "a"})
        values = intake.read(OPENAI_CHAT, req, response_format=req.response_format, max_new_tokens=8,
                             return_logprob=True, top_logprobs_num=2).values
        SamplingParams(**{k: v for k, v in values.items() if v is not None}).validate()  # None: the default
        reached |= set(values)
    assert reached == set(PARAMS) - set(GATEWAY_DERIVED)


# ---------------------------------------------------------------- the API schemas derive from SamplingParams
def _api_default(model, dialect: Dialect, name: str):
    info = model.model_fields[dialect.api_name(name)]
    return info.default


def test_every_api_schema_has_each_runtime_field_with_its_default():
    """Native sampling_params default to the runtime's values; OpenAI's nullable fields to null, which the intake
    reads as the runtime's default (and so does a request that leaves them out)."""
    for model, dialect in ((NativeSampling, NATIVE), (ChatCompletionRequest, OPENAI_CHAT),
                           (CompletionRequest, OPENAI_COMPLETION)):
        for f in dialect.carried():
            default = _api_default(model, dialect, f.name)
            if default is None and f.default is not None:
                assert f.name in dialect.nullable or isinstance(f.default, tuple), (model.__name__, f.name)
            else:
                assert default == f.default, (model.__name__, f.name, default, f.default)
    bare = [(NATIVE, NativeSampling()), (OPENAI_CHAT, ChatCompletionRequest(messages=[{"role": "user",
                                                                                     "content": "x"}])),
            (OPENAI_COMPLETION, CompletionRequest(prompt="x"))]
    for dialect, request in bare:
        values = intake.read(dialect, request, max_new_tokens=SamplingParams.max_new_tokens).values
        assert SamplingParams(**{k: v for k, v in values.items() if v is not None}) == SamplingParams(), dialect.name


def test_the_api_names_are_sglangs_and_openais():
    assert OPENAI_CHAT.renamed == {
        "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs_num": "top_logprobs",
        "return_logprob": "logprobs"}
    assert OPENAI_COMPLETION.renamed["top_logprobs_num"] == "logprobs"
    assert NATIVE.renamed == {"seed": "sampling_seed"}
    assert {"sampling_seed", "max_new_tokens", "min_new_tokens"} <= set(NativeSampling.model_fields)
    assert {"min_tokens", "seed", "n", "logit_bias"} <= set(ChatCompletionRequest.model_fields)


@dataclasses.dataclass(frozen=True)
class WithTypicalP(SamplingParams):
    """SamplingParams with one more parameter, as a change adding it would write it (its validate line aside)."""

    typical_p: float = 1.0
    banned_ids: tuple[int, ...] = ()


def test_a_new_runtime_field_reaches_every_api_with_no_gateway_edit():
    """What adding a parameter takes: the SamplingParams field (and its validate line), the proto field (the tests
    above fail until it is there; the codec needs no edit), and the sampler's code. The gateway derives the rest."""
    for dialect in (NATIVE, OPENAI_CHAT):
        fields_ = sampling_fields(dialect, WithTypicalP)
        assert fields_["typical_p"] == (float, 1.0)
        assert fields_["banned_ids"] == (list[int] | None, None)
    model = create_model("NativeWithTypicalP", **sampling_fields(NATIVE, WithTypicalP))
    request = model.model_validate({"typical_p": 0.9, "banned_ids": [3, 4], "sampling_seed": 7})
    draft = intake.read(NATIVE, request, params=WithTypicalP)
    built = intake.build_params(draft, vocab_size=100, params=WithTypicalP)
    assert (built.typical_p, built.banned_ids, built.seed) == (0.9, (3, 4), 7)
    assert intake.build_params(intake.read(NATIVE, model(), params=WithTypicalP), 100, WithTypicalP).typical_p == 1.0
