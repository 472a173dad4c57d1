"""A request parameter has one definition (shared/sampling_params.py); the wire format and the APIs must agree
with it. Each test here fails when a parameter is added in one place and forgotten in another."""
from __future__ import annotations

import ast
import typing
from dataclasses import fields
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.constraints import GATEWAY_DERIVED
from pdserve.services.gateway.native_api import NATIVE_NAMES, native_values
from pdserve.services.gateway.openai_api import sampling_values
from pdserve.services.gateway.protocol import ChatCompletionRequest, NativeSampling
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
    missing = {NATIVE_NAMES.get(n, n) for n in PARAMS} - set(NativeSampling.model_fields) \
        - {"return_logprob", "top_logprobs_num", "logprob_start_len"} - set(GATEWAY_DERIVED)  # request-level
    assert not missing
    values = native_values(NativeSampling(logit_bias={"1": 2.0}, regex="a"), 8, True, 2, 0)
    assert set(values) == set(PARAMS) - (set(CONSTRAINT_FIELDS) - {"regex"}) - set(GATEWAY_DERIVED)
    SamplingParams(**values).validate()


def test_openai_requests_reach_every_runtime_field():
    reached = set()
    for constraint in CONSTRAINT_FIELDS:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                    "logit_bias": {"3": 1}, constraint: "a"})
        values, _ = sampling_values(req, 8, True, 2)
        SamplingParams(**{k: v for k, v in values.items() if v is not None}).validate()  # None: the default
        reached |= set(values)
    assert reached == set(PARAMS) - set(GATEWAY_DERIVED)
