"""A role's engine side, and the plain case: a colocated worker's engine computes every prompt it decodes, holds no
side of KV transfers and adds nothing to the engine. `prefill_engine.py` and `decode_engine.py` override what
their role adds; the front's side of each role is its wiring (`colocated_wiring.py`, `prefill_wiring.py`, `decode_wiring.py`).

Plug points, all a role has to say:
- `role`, `serves_pooling_models`, `ends_at_prefill` (its metrics count a request done once prefilled),
  `switches_roles` (it may take another role live);
- `transfer_spec(args)` and `transfer_agent(spec, runner)`: its KV transfer agent (colocated: `NoTransfer`);
- `engine_hooks()`: what it hands the Engine (a prefill's KV write, a decode's transfer poll);
- `admitting(req)`: a generation about to be added (a decode's pages reserved are told to the front);
- its own calls, each a method marked `handles(<call type>)`.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdserve.shared.config import Role
from pdserve.shared.req import Req

if TYPE_CHECKING:
    from pdserve.services.worker.engine.engine_worker import WorkerEngine


class ColocatedEngine:
    role = Role.COLOCATED
    serves_pooling_models = True  # embeddings and scores need no prefill/decode split: only colocated serves them
    ends_at_prefill = False
    switches_roles = False  # prefill and decode switch live into each other (engine_admin_calls.switch_role)

    def __init__(self, worker: WorkerEngine) -> None:
        self.worker = worker

    @staticmethod
    def transfer_spec(args: argparse.Namespace):
        return None

    @staticmethod
    def transfer_agent(spec, runner) -> tuple[object, str]:
        """The agent every rank made (a tensor-parallel worker's, at this point), and its backend's name."""
        return NoTransfer(), "none"

    def engine_hooks(self) -> dict:
        return {}

    def admitting(self, req: Req) -> None:
        pass


class NoTransfer:
    """The KV transfer agent of a worker that moves no KV: always healthy, nothing to close."""

    page_bytes, name = 0, ""

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


def rank_agent(spec, runner) -> tuple[object, str]:
    """A prefill or decode worker's agent, made by every rank of a tensor-parallel worker."""
    from pdserve.shared.tp_transfer import rank_transfers

    return rank_transfers(spec, runner.tp, runner), spec.backend
