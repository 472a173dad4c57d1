"""Conversions between runtime dataclasses and the worker proto messages."""
from __future__ import annotations

from pdserve.proto import worker_pb2 as pb
from pdserve.shared.compat import Compat
from pdserve.shared.engine import FirstToken
from pdserve.shared.req import ReqOutput


def output_to_proto(out: ReqOutput) -> pb.ChoiceDelta:
    return pb.ChoiceDelta(
        index=out.index,
        token_ids=out.token_ids,
        logprobs=[lp.logprob for lp in out.logprobs],
        top_logprobs=[pb.TopLogprob(token_ids=lp.top_ids, logprobs=lp.top_logprobs) for lp in out.logprobs],
        finish_reason=out.finish_reason or "",
        matched_stop_token=-1 if out.matched_stop_token is None else out.matched_stop_token,
    )


def first_token_to_proto(first: FirstToken) -> pb.FirstToken:
    if first.logprob is None:
        return pb.FirstToken(token_id=first.token_id)
    return pb.FirstToken(token_id=first.token_id, has_logprob=True, logprob=first.logprob.logprob,
                         top=pb.TopLogprob(token_ids=first.logprob.top_ids, logprobs=first.logprob.top_logprobs))


def compat_to_proto(compat: Compat) -> pb.Compat:
    return pb.Compat(**compat.to_dict())


def compat_from_proto(msg: pb.Compat) -> Compat:
    return Compat(model=msg.model, dtype=msg.dtype, page_size=msg.page_size, num_layers=msg.num_layers,
                  num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, transfer_backend=msg.transfer_backend)
