"""A request parameter has one definition (shared/sampling_params.py); the wire format and the APIs must agree
with it. Each test here fails when a parameter is added in one place and forgotten in another.

Adding a parameter is three edits: its field (default, range and marks, through `param`), its proto field, and
the sampler's code. The tests at the end show it with fields declared in a subclass: validation, has_penalty,
migration and every API take them from the definition, and the code that reads the definitions names no field."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import fields
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor
from pydantic import create_model

from pdserve.proto import codec, worker_pb2 as pb
from pdserve.services.gateway import intake
from pdserve.services.gateway.intake.dialects import (GATEWAY_DERIVED, NATIVE, OPENAI_CHAT, OPENAI_COMPLETION, Dialect,
                                               sampling_fields)
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.protocol import ChatCompletionRequest, CompletionRequest, NativeSampling
from pdserve.services.gateway.workers.migration import why_not_movable
from pdserve.shared import sampling_params
from pdserve.shared.sampling_params import CONSTRAINT_FIELDS, InvalidParam, SamplingParams, param, spec_of

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
        - {"return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob", "cache_salt"} \
        - set(GATEWAY_DERIVED)
    assert not missing  # those: request-level fields of /generate
    draft = intake.read(NATIVE, NativeSampling(logit_bias={"1": 2.0}, regex="a", max_new_tokens=8),
                        return_logprob=True, top_logprobs_num=2, logprob_start_len=0, token_ids_logprob=(5,),
                        cache_salt="tenant")
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
    assert reached == set(PARAMS) - set(GATEWAY_DERIVED) - {"token_ids_logprob"}  # /generate's only, as SGLang


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


# ---------------------------------------------------------------- a new parameter: three edits
@dataclasses.dataclass(frozen=True)
class WithTypicalP(SamplingParams):
    """SamplingParams with more parameters, declared as a change adding them would declare them: nothing else in
    the runtime or the gateway is edited for them (the proto field and the sampler's code aside)."""

    typical_p: float = param(1.0, lo=0.0, hi=1.0, lo_open=True)
    banned_ids: tuple[int, ...] = ()
    novelty_penalty: float = param(0.0, lo=-2.0, hi=2.0, penalty=0.0, unmovable="requests with a novelty penalty")


@pytest.mark.parametrize("values, field, message", [
    ({"typical_p": 1.5}, "typical_p", "typical_p must be in (0, 1], got 1.5"),
    ({"typical_p": 0.0}, "typical_p", "typical_p must be in (0, 1], got 0.0"),
    ({"typical_p": "high"}, "typical_p", "typical_p must be a number, got 'high'"),
    ({"banned_ids": [3, 100]}, "banned_ids", "banned_ids must hold token ids in [0, 99], got 100"),
    ({"novelty_penalty": -2.5}, "novelty_penalty", "novelty_penalty must be in [-2, 2], got -2.5"),
])
def test_a_new_field_is_validated_from_its_definition(values, field, message):
    with pytest.raises(InvalidParam) as info:
        WithTypicalP(**values).validate(vocab_size=100)
    assert (info.value.field, str(info.value)) == (field, message)
    WithTypicalP(typical_p=0.5, banned_ids=[3, 99], novelty_penalty=2.0).validate(vocab_size=100)
    assert WithTypicalP(banned_ids=[3, 4]).banned_ids == (3, 4)  # lists arrive from JSON and proto


def test_a_new_penalty_is_seen_by_the_runtime_and_by_migration():
    assert WithTypicalP(novelty_penalty=0.5).has_penalty  # the sampler, overlap and speculation ask this
    assert not WithTypicalP(typical_p=0.5, banned_ids=(1,)).has_penalty
    assert why_not_movable(WithTypicalP(novelty_penalty=0.5)) == \
        "requests with a novelty penalty are not moved to another worker mid-stream"
    assert why_not_movable(WithTypicalP(typical_p=0.5, banned_ids=(1,))) is None


def test_the_marks_of_todays_fields():
    penalties = {f.name: spec_of(f).neutral for f in fields(SamplingParams) if spec_of(f).neutral is not None}
    assert penalties == {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
    for name, neutral in penalties.items():
        assert SamplingParams(**{name: neutral + 0.5}).has_penalty, name
    assert not SamplingParams().has_penalty
    unmovable = {f.name for f in fields(SamplingParams) if spec_of(f).unmovable is not None}
    # Every state the worker keeps for a request is rebuilt from its output so far (shared/resume.py).
    assert unmovable == set()


# validate() names fields only for its rules across fields: min_new_tokens <= max_new_tokens (and at most one of
# CONSTRAINT_FIELDS, which it reads through that tuple). Everything else comes from the definitions.
CROSS_FIELD = {"min_new_tokens", "max_new_tokens"}


def _fields_named(source: str, names) -> set[str]:
    named = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            named.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            named.add(node.value)
    return named


def test_the_code_that_reads_the_definitions_names_no_field():
    assert _fields_named(inspect.getsource(SamplingParams.validate), PARAMS) == CROSS_FIELD
    assert not _fields_named(inspect.getsource(SamplingParams.__dict__["has_penalty"].func), PARAMS)
    assert not _fields_named(inspect.getsource(SamplingParams.__post_init__), PARAMS)
    assert not _fields_named(inspect.getsource(why_not_movable), PARAMS)
    checks = [f for name, f in vars(sampling_params).items()
              if inspect.isfunction(f) and f.__module__ == sampling_params.__name__]
    assert len(checks) > 5
    for check in checks:
        assert not _fields_named(inspect.getsource(check), PARAMS), check.__name__
    assert not _fields_named(Path(codec.__file__).read_text(), PARAMS)  # the wire format is converted by name


def _away_from_default(f: dataclasses.Field, hint) -> object:
    """A value of the field's type that is neither its default nor proto3's zero (so the message must carry it)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if type(None) in typing.get_args(hint) else hint
    spec = spec_of(f)
    if typing.get_origin(base) is tuple:
        return ((1, 0.5), (4, -1.5)) if typing.get_origin(typing.get_args(base)[0]) is tuple else (1, 2)
    if base is bool:
        return not f.default
    if base is str:
        return "a"
    if base is int:
        start = f.default or 0
        return next(v for v in (start + 1, start + 2, start - 1) if v != 0 and (spec.hi is None or v <= spec.hi))
    return next(v for v in (f.default + 0.25, f.default - 0.25) if v != 0 and (spec.hi is None or v <= spec.hi))


def test_the_codec_carries_every_field_with_no_edit():
    """Every field away from its default reaches the message and comes back: the codec is driven by the message's
    descriptor, so the proto field is the only wire edit a new parameter needs."""
    params = SamplingParams(**{name: _away_from_default(f, HINTS[name]) for name, f in PARAMS.items()})
    msg = codec.params_to_proto(params)
    assert {field.name for field, _ in msg.ListFields()} == set(PROTO)
    assert codec.params_from_proto(pb.SamplingParams.FromString(msg.SerializeToString())) == params


def test_a_new_runtime_field_reaches_every_api_with_no_gateway_edit():
    """The gateway derives the new fields' API schema from the dataclass, and refuses a bad value by the API's
    name with the definition's range."""
    for dialect in (NATIVE, OPENAI_CHAT):
        fields_ = sampling_fields(dialect, WithTypicalP)
        assert fields_["typical_p"] == (float, 1.0)
        assert fields_["banned_ids"] == (list[int] | None, None)
        assert fields_["novelty_penalty"] == (float, 0.0)
    model = create_model("NativeWithTypicalP", **sampling_fields(NATIVE, WithTypicalP))
    request = model.model_validate({"typical_p": 0.9, "banned_ids": [3, 4], "novelty_penalty": 0.5,
                                    "sampling_seed": 7})
    draft = intake.read(NATIVE, request, params=WithTypicalP)
    built = intake.build_params(draft, vocab_size=100, params=WithTypicalP)
    assert (built.typical_p, built.banned_ids, built.novelty_penalty, built.seed) == (0.9, (3, 4), 0.5, 7)
    assert intake.build_params(intake.read(NATIVE, model(), params=WithTypicalP), 100, WithTypicalP).typical_p == 1.0
    with pytest.raises(ApiError) as info:
        intake.build_params(intake.read(NATIVE, model(typical_p=1.5), params=WithTypicalP), 100, WithTypicalP)
    assert (info.value.status, info.value.param) == (400, "typical_p")
    assert "typical_p must be in (0, 1], got 1.5" in info.value.message
