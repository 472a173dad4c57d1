"""A worker's role (colocated, prefill or decode) as the object its engine calls at fixed points of each step.

`engine_role.py` documents those points and writes the plain case (`EngineRole`), which `colocated.py` is; `prefill.py`
and `decode.py` hold what only a prefill or a decode worker does, each lifecycle in one file.
"""
from __future__ import annotations

from typing import Callable

from pdserve.shared.config import Role
from pdserve.shared.roles.engine_role import EngineRole
from pdserve.shared.roles.colocated import ColocatedRole
from pdserve.shared.roles.decode import DecodeRole
from pdserve.shared.roles.prefill import AddFn, PrefillRole, TransferFn
from pdserve.shared.step_ops import StepOps

__all__ = ["ColocatedRole", "DecodeRole", "EngineRole", "PrefillRole", "TransferFn", "make_role"]


def make_role(kind: Role, ops: StepOps, add_request: AddFn, transfer_fn: TransferFn | None = None,
              poll_fn: Callable[[], None] | None = None) -> EngineRole:
    """`add_request` is the engine's (a prefill worker's calls queue through it); `transfer_fn` writes a
    prefilled prompt's KV to its decode worker; `poll_fn` lets a decode worker's
    transfer make progress between steps (NIXL's target side must keep polling)."""
    if kind == Role.PREFILL:
        return PrefillRole(ops, add_request, transfer_fn)
    if kind == Role.DECODE:
        return DecodeRole(ops, poll_fn)
    return ColocatedRole(ops)
