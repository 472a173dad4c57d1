"""The one place where runtime values become worker proto messages and back.

The runtime library (pdserve.shared) never imports the wire format; the gateway and the workers convert here.
SamplingParams is converted field by field by name, driven by the message's descriptor, so a parameter added to
both definitions needs no edit here (tests/shared/test_param_definitions.py checks that they agree).
"""
from __future__ import annotations

import struct
from dataclasses import fields

from google.protobuf.descriptor import FieldDescriptor

from pdserve.proto import worker_pb2 as pb
from pdserve.shared.compat import Compat, WeightsVersion
from pdserve.shared.outputs import FirstToken, ReqOutput, TokenLogprobs
from pdserve.shared.sampling_params import SamplingParams

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


# ------------------------------------------------------------------ sampling parameters
def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The message the gateway sends; every field is filled, so proto3's zero defaults never stand in for a value."""
    msg = pb.SamplingParams()
    for name in _PARAM_FIELDS:
        value = getattr(params, name)
        field = pb.SamplingParams.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            getattr(msg, name).update(dict(value))
        elif _is_repeated(field):
            getattr(msg, name).extend(value)
        elif value is not None:
            setattr(msg, name, value)
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from a fully filled message; raises InvalidParam for an out-of-range value."""
    values = {}
    for name in _PARAM_FIELDS:
        field = pb.SamplingParams.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            values[name] = {k: _from_float32(v) for k, v in getattr(msg, name).items()}
        elif _is_repeated(field):
            values[name] = tuple(getattr(msg, name))
        elif field.has_presence and not msg.HasField(name):
            values[name] = None
        elif field.type == FieldDescriptor.TYPE_FLOAT:
            values[name] = _from_float32(getattr(msg, name))
        else:
            values[name] = getattr(msg, name)
    # Not validated here: the worker's edge is Engine.add_request, which validates once, against the model too.
    return SamplingParams(**values)


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def _from_float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32, so 0.7 sent as float32 arrives as 0.7 again."""
    target = struct.pack("<f", value)
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == target:
            return short
    return value


# ------------------------------------------------------------------ a generation continued (migration)
def resume_to_proto(outputs: dict[int, list[int]]) -> list[pb.ResumedChoice]:
    """{choice index: its output so far} of the choices still running, as GenerateRequest.resume."""
    return [pb.ResumedChoice(index=i, output_ids=ids) for i, ids in sorted(outputs.items())]


def resume_from_proto(request: pb.GenerateRequest) -> list[tuple[int, list[int]]] | None:
    """(choice index, its output so far) of each choice of a resumed generation; None for a fresh one (the
    engine checks them: Engine.add_request)."""
    return [(c.index, list(c.output_ids)) for c in request.resume] if request.resume else None


# ------------------------------------------------------------------ outputs and first tokens
def output_to_proto(out: ReqOutput) -> pb.ChoiceDelta:
    return pb.ChoiceDelta(
        index=out.index,
        token_ids=out.token_ids,
        logprobs=[lp.logprob for lp in out.logprobs],
        top_logprobs=[pb.TopLogprob(token_ids=lp.top_ids, logprobs=lp.top_logprobs) for lp in out.logprobs],
        token_ids_logprobs=[pb.TopLogprob(logprobs=lp.id_logprobs) for lp in out.logprobs if lp.id_logprobs],
        finish_reason=out.finish_reason or "",
        matched_stop_token=-1 if out.matched_stop_token is None else out.matched_stop_token,
    )


def first_token_to_proto(first: FirstToken) -> pb.FirstToken:
    if first.logprob is None:
        return pb.FirstToken(token_id=first.token_id)
    lp = first.logprob
    return pb.FirstToken(token_id=first.token_id, has_logprob=True, logprob=lp.logprob,
                         top=pb.TopLogprob(token_ids=lp.top_ids, logprobs=lp.top_logprobs),
                         ids=pb.TopLogprob(logprobs=lp.id_logprobs))


def prompt_logprobs_to_proto(logprobs: list[TokenLogprobs]) -> list[pb.PromptLogprob]:
    return [pb.PromptLogprob(logprob=lp.logprob, top=pb.TopLogprob(token_ids=lp.top_ids, logprobs=lp.top_logprobs),
                             ids=pb.TopLogprob(logprobs=lp.id_logprobs)) for lp in logprobs]


def first_token_from_proto(msg: pb.FirstToken) -> FirstToken:
    if not msg.has_logprob:
        return FirstToken(msg.token_id, None)
    return FirstToken(msg.token_id, TokenLogprobs(msg.logprob, list(msg.top.token_ids), list(msg.top.logprobs),
                                                  list(msg.ids.logprobs)))


# ------------------------------------------------------------------ peer compatibility
def compat_to_proto(compat: Compat) -> pb.Compat:
    return pb.Compat(**compat.to_dict())


def compat_from_proto(msg: pb.Compat) -> Compat:
    return Compat(model=msg.model, dtype=msg.dtype, page_size=msg.page_size, num_layers=msg.num_layers,
                  num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, transfer_backend=msg.transfer_backend,
                  lora_adapters=tuple(msg.lora_adapters), weights_version=msg.weights_version,
                  quantization=msg.quantization)


# ------------------------------------------------------------------ weights version
def weights_to_proto(version: WeightsVersion) -> pb.WeightsVersion:
    return pb.WeightsVersion(number=version.number, path=version.path, tag=version.tag)


def weights_from_proto(msg: pb.WeightsVersion) -> WeightsVersion:
    return WeightsVersion(msg.number, msg.path, msg.tag)
