"""The sending side of KV transfers, on the engine side of the workers that write KV into a decode worker's pages:
a prefill worker (each prompt it fills) and a decode worker (the generations it moves out live,
shared/roles/move_out.py).

`KVSender` serves what every sender takes: the receivers' registration (AddPeer, RemovePeer) and Fence (revoke a
reservation, then drop its request). `MoveOutCalls` serves a decode worker's moves: Freeze (mark generations) and
MoveOut (write a frozen generation's pages into the destination's reservation under its fence, then free them;
answered as a Prefill call is, its first token the one held back). Writes run on the engine thread, as a
prefill's do.
"""
from __future__ import annotations

import logging
import os
import time

from pdserve.services.worker.channel.messages import AddPeer, Fence, Freeze, MoveOut, RemovePeer
from pdserve.services.worker.engine.engine_calls import wire_lps
from pdserve.services.worker.engine.engine_worker import handles
from pdserve.shared.transfer.fence import Fence as WriteFence

log = logging.getLogger("pdserve.worker")
ABORT_WAIT_S = 1.0  # a fence's revocation waits this long for the engine to drop the request, then reports it
# Tests only: every KV write of a sender waits this long first (a write late past its request's abort, a worker
# killed mid-move).
WRITE_DELAY_ENV = "PDSERVE_TEST_KV_WRITE_DELAY_S"


class KVSender:
    worker: object  # the WorkerEngine, set by the role's engine class

    @handles(Fence, where="thread")
    def fence(self, call: Fence) -> dict:
        """Revoke a reservation's fence (no write of it starts from now on; returns once none is under way), then
        drop its request. What could not be done is logged, counted and answered, never swallowed."""
        w, rid, errors = self.worker, call.rid, []
        fenced = w.transfer.revoke(call.peer_name, call.fence)
        if not fenced:  # cannot happen while every write ends within its timeout (fence.WRITE_BOUND_S)
            w.metrics.fence_failed("write_still_running")
            errors.append(f"a KV write of {rid} to {call.peer_name} was still under way")
        try:
            w.on_engine(lambda: w.engine.abort(rid, error="its KV reservation was revoked"), ABORT_WAIT_S)
        except Exception as exc:  # the abort stays queued; the request's writes are refused meanwhile
            w.metrics.fence_failed("abort_late")
            errors.append(f"the engine did not drop {rid} within {ABORT_WAIT_S:g} s ({type(exc).__name__}): its "
                          "KV writes are refused meanwhile")
        for error in errors:
            log.warning("revoking the KV reservation of %s at %s: %s", rid, call.peer_name, error)
        return {"fenced": fenced, "error": "; ".join(errors)}

    @handles(AddPeer, where="thread")
    def add_peer(self, call: AddPeer) -> tuple[bool, bytes]:
        """Connect a registering decode worker (idempotent); returns whether it was known, and our metadata."""
        transfer = self.worker.transfer
        known = transfer.has_peer(call.name)
        self.worker.on_kv_thread(lambda: transfer.add_peer(call.name, call.metadata))
        return known, transfer.metadata()

    @handles(RemovePeer)
    def remove_peer(self, call: RemovePeer) -> None:  # on the engine thread: no transfer to it is under way
        self.worker.transfer.remove_peer(call.name)


class MoveOutCalls(KVSender):
    def __init__(self, worker) -> None:
        super().__init__(worker)
        self._write_delay_s = float(os.environ.get(WRITE_DELAY_ENV) or 0)
    @handles(Freeze)
    def freeze(self, call: Freeze) -> tuple[list[str], list[str]]:
        engine = self.worker.engine
        running = sorted(engine.scheduler.live_reqs(), key=lambda r: r.arrival, reverse=True)
        if call.all:
            chosen = running
        elif call.count:
            chosen = running[:call.count]
        else:
            chosen = [r for r in running if r.rid in set(call.rids)]
        marked, refused = engine.role.moves.freeze(chosen, call.reason)
        missing = set(call.rids) - {r.rid for r in chosen}
        return marked, refused + [f"{rid}: not running here" for rid in sorted(missing)]

    @handles(MoveOut, where="thread")
    def move_out(self, call: MoveOut) -> dict:
        w = self.worker
        if not w.transfer.has_peer(call.peer_name):  # we restarted since it registered
            raise PermissionError(f"decode worker {call.peer_name} is not registered")
        return w.on_engine(lambda: self._write(call))

    def _write(self, call: MoveOut) -> dict:
        """Engine thread: the frozen generation's pages into the caller's; freed here whether they went or not."""
        w = self.worker
        moves = w.engine.role.moves
        frozen = moves.frozen_for(call.source_rid, list(call.token_ids))
        pages = frozen.req.pages
        if len(call.dst_pages) != len(pages):
            raise ValueError(f"{len(call.dst_pages)} pages reserved for {call.source_rid}, which holds {len(pages)}")
        if self._write_delay_s:
            time.sleep(self._write_delay_s)
        t0 = time.perf_counter()
        try:
            w.transfer.write_pages(call.peer_name, list(pages), list(call.dst_pages),
                                   fence=WriteFence(call.fence, call.fence_deadline) if call.fence else None)
        except Exception:
            w.metrics.transfer_failed(call.peer_name)
            raise
        finally:
            moves.release(call.source_rid)
        seconds = time.perf_counter() - t0
        w.metrics.transferred(call.peer_name, len(pages) * w.transfer.page_bytes, seconds)
        return {"first_tokens": [(frozen.token, wire_lps(frozen.logprob))], "cached_tokens": frozen.req.cached_tokens,
                "queue_s": 0.0, "compute_s": 0.0, "transfer_s": seconds, "tier_tokens": {}, "input_logprobs": [],
                "trace": None, "bytes": len(pages) * w.transfer.page_bytes}
