"""A decode worker's engine side: it holds the receiving side of KV transfers. A generation whose prompt a prefill
worker fills gets its pages reserved by the engine; this side opens their transfer window under a fresh fence and
tells the front (`PagesReserved`), which asks the prefill worker (`kv_pull.py`), then hands back the answer
(KVAnswered: the window closes, the engine takes the first tokens) and the settled fence (KVSettle: an aborted
request's pages go back to the pool). Its engine polls the transfer agent every step. It is a sender too, of the
generations it moves out live to another decode worker (`kv_sender.MoveOutCalls`)."""
from __future__ import annotations

import argparse
import time

from pdserve.services.worker.engine.colocated_engine import ColocatedEngine, rank_agent
from pdserve.services.worker.engine.engine_calls import lps
from pdserve.services.worker.channel.messages import KVAnswered, KVSettle, PagesReserved, TransferMetadata
from pdserve.services.worker.engine.engine_worker import handles
from pdserve.services.worker.engine.kv_sender import MoveOutCalls
from pdserve.services.worker.channel.settings import transfer_backend
from pdserve.shared.config import Role
from pdserve.shared.outputs import FirstToken
from pdserve.shared.req import Req


class DecodeEngine(MoveOutCalls, ColocatedEngine):
    role = Role.DECODE
    serves_pooling_models = False
    switches_roles = True

    @staticmethod
    def transfer_spec(args: argparse.Namespace):
        from pdserve.shared.tp_transfer import TransferSpec

        # TCP's receiving side listens: rank r on port + r.
        return TransferSpec(transfer_backend(args), args.worker_name, args.host,
                            args.transfer_port or args.port + 2000)

    transfer_agent = staticmethod(rank_agent)

    def engine_hooks(self) -> dict:
        return {"poll_fn": self.worker.transfer.poll}

    def admitting(self, req: Req) -> None:  # its prompt's KV is written here by a prefill worker
        req.on_pages_reserved = self._pages_reserved

    def _pages_reserved(self, req: Req) -> None:  # engine thread: the prefill worker may fill them now
        transfer = self.worker.transfer
        fence = transfer.open_window(list(req.pages))
        self.worker.event(PagesReserved(req.rid, list(req.pages), (req.lora and req.lora.version) or "", fence,
                                        transfer.checks_every_write))

    @handles(TransferMetadata, where="here")
    def transfer_metadata(self, call: TransferMetadata) -> bytes:
        return self.worker.transfer.metadata()

    @handles(KVAnswered, where="thread")
    def kv_answered(self, call: KVAnswered) -> float:
        """The prefill worker answered after its last write: close the window before the engine takes the pages
        (caching them may free some for the next request reserved at once); returns when it closed."""
        w = self.worker
        w.on_kv_thread(lambda: w.transfer.close_window(call.pages))
        closed = time.monotonic()
        tokens = [FirstToken(t, lps(lp)) for t, lp in call.firsts]
        w.on_engine(lambda: w.engine.role.kv_ready(call.rid, tokens, call.cached_tokens))
        return closed

    @handles(KVSettle, where="thread")
    def kv_settle(self, call: KVSettle) -> None:
        """The reservation's fence is settled (kv_pull.py): no write can land in `pages` once its window is closed;
        an aborted request's pages go back to the pool then."""
        w = self.worker
        if call.lease_expired:
            w.metrics.fence_failed("lease_expired")
        if not call.closed:
            w.on_kv_thread(lambda: w.transfer.close_window(call.pages))
        w.on_engine(lambda: w.engine.role.kv_settled(call.rid))
