"""A prefill worker: serves the Prefill service (through the app's gate, `prefill_rpc.PrefillGate`: decode workers register, then ask for prompts to be filled into
their pages: `prefill_rpc.py`) and Pooling (scores need only a prompt); refuses Generate; its engine holds the
sending side of KV transfers (`prefill_engine.py`). Draining, it still fills the prompts decode workers already
took."""
from __future__ import annotations

import grpc

from pdserve.services.worker.front.prefill_rpc import PrefillService
from pdserve.services.worker.front.wiring import Wiring
from pdserve.shared.config import Role


class Prefill(Wiring):
    role = Role.PREFILL
    switches_roles = True

    def refuses_generate(self, request) -> tuple[grpc.StatusCode, str] | None:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                "this is a prefill worker: send Generate to a decode or colocated worker")

    async def serve(self, app, server, calls) -> None:
        self.service = PrefillService(app.link, app.compat, calls=calls, page_bytes=app.engine_info["page_bytes"],
                                      transfer_name=app.engine_info["transfer_name"])

    def weights_changed(self, compat) -> None:  # what registration exchanges names the new weights
        self.service.compat = compat
