"""How a worker of one role is wired in its front: the services it serves, where Generate gets a prompt's KV from,
and what it does once serving. Each role says it in one module: `colocated_wiring.py` (the plain case: these defaults),
`prefill_wiring.py`, `decode_wiring.py`; its engine side is beside it (`colocated_engine.py`, `prefill_engine.py`,
`decode_engine.py`: the KV transfer side it holds, the calls only it serves); an embedding model's worker is
`encoder_app.py`. `app.py` and `rpc.py` ask the wiring and hold no role checks of their own.
"""
from __future__ import annotations

import grpc

from pdserve.shared.config import Role


class ComputedHere:
    """Where a generation's prompt KV comes from: computed by this worker's engine, nothing to do here. A decode
    worker's prompts are pulled from prefill workers instead (`kv_pull.KVPull`, with the same calls)."""

    def expect(self, rid: str, request) -> None:
        pass

    def abort(self, rid: str) -> None:
        pass

    def take_reply(self, rid: str):
        return None  # a prefill worker's reply with its timings: none here


class Wiring:
    role = Role.COLOCATED
    # What ends a Generate call that failed here; decode's UNAVAILABLE makes the gateway migrate the stream.
    failure_code = grpc.StatusCode.INTERNAL
    refuses_pooling: str | None = None  # why Encode calls are refused here, if they are
    switches_roles = False  # prefill and decode workers switch live into each other (role_switch.py)
    moves_live = False  # it hands running generations over live with their KV (Migrate: move_rpc.py)

    def __init__(self) -> None:
        self.prompt_kv = ComputedHere()

    def refuses_generate(self, request) -> tuple[grpc.StatusCode, str] | None:
        """Why this Generate call cannot be served here (the status and the message), or None."""
        return None

    def first_output_wait(self, stall_s: float, prefill_s: float) -> float:
        """How long a generation may wait for its first output."""
        return stall_s

    async def serve(self, app, server, calls) -> None:
        """Build this role's own parts (at start, or when the worker switches to this role: role_switch.py)."""

    async def start(self, app) -> None:
        """Once serving, before ready (at start only)."""

    async def register(self, prefill_addrs: list[str], deadline_s: float) -> None:
        """Switched to this role: meet the prefill workers named (a decode worker registers with them)."""

    async def stop(self) -> None:
        """Switched away from this role: end what it runs in the background."""

    def weights_changed(self, compat) -> None:
        """This worker now serves other weights: what its peers are told changes."""

