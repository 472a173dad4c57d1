"""A decode worker: Generate pulls each prompt's KV from the prefill worker the request names (`kv_pull.KVPull`:
the engine reserves the pages, the prefill worker writes them) unless its own prefix cache holds nearly all of it;
registers with the prefill workers it is given (`peers.py`) before it is ready; refuses Pooling; its engine holds
the receiving side of KV transfers (`decode_engine.py`). A generation that fails here ends UNAVAILABLE, which the
gateway migrates."""
from __future__ import annotations

import logging

import grpc

from pdserve.services.worker.channel.messages import PagesReserved, TransferMetadata
from pdserve.services.worker.front.kv_pull import KVPull
from pdserve.services.worker.front.peers import PeerError, PrefillPeers
from pdserve.services.worker.front.prefill_rpc import PrefillService
from pdserve.services.worker.front.wiring import Wiring
from pdserve.shared.addresses import expand_hostports
from pdserve.shared.config import Role

log = logging.getLogger("pdserve.worker")


class Decode(Wiring):
    role = Role.DECODE
    failure_code = grpc.StatusCode.UNAVAILABLE
    switches_roles = True
    refuses_pooling = "this is a decode worker: send prefill-only requests to a prefill or colocated worker"
    moves_live = True

    def refuses_generate(self, request) -> tuple[grpc.StatusCode, str] | None:
        if request.prefill_addr or request.resume:  # a resumed generation is computed here (shared/resume.py)
            return None
        return grpc.StatusCode.INVALID_ARGUMENT, "a decode worker needs prefill_addr"

    def first_output_wait(self, stall_s: float, prefill_s: float) -> float:
        return prefill_s + stall_s  # its prompt is filled elsewhere first

    async def serve(self, app, server, calls) -> None:
        self.peers = PrefillPeers(app.name, app.compat, await app.link.call(TransferMetadata()))
        self.prompt_kv = KVPull(app.link, self.peers, app.timeouts.engine_call, app.timeouts.prefill,
                              lambda: self.peers.compat.weights_version)
        app.link.on(PagesReserved, self.prompt_kv.reserved)
        # The Prefill service of a decode worker hands its frozen generations' KV to the decode worker that
        # continues them (a live move, shared/roles/move_out.py), registration and fences as a prefill worker's.
        self.service = PrefillService(app.link, app.compat, calls=calls, page_bytes=app.engine_info["page_bytes"],
                                      transfer_name=app.engine_info["transfer_name"], moves_only=True)

    async def start(self, app) -> None:
        addrs = [a for spec in app.args.prefill for a in expand_hostports(spec)]
        if addrs:
            await self.peers.register_all(addrs, deadline_s=120)

    def weights_changed(self, compat) -> None:
        self.peers.compat = compat
        self.service.compat = compat

    async def register(self, prefill_addrs: list[str], deadline_s: float) -> None:
        try:  # one not reached now is registered with at its first request
            await self.peers.register_all(prefill_addrs, deadline_s)
        except PeerError as exc:
            log.warning("after the role switch: %s", exc)

    async def stop(self) -> None:
        await self.peers.close()
