"""Migrate, the Worker service's start of a live move (shared/roles/move_out.py): a decode worker freezes the
generations asked for at their next step boundary, and each one's stream ends ABORTED "moved: <reason>"; the
gateway continues it on another decode worker, whose KV pull takes the pages from here (kv_pull.py, prefill_rpc.py
`moves_only`). A mixin of `rpc.WorkerService`; other roles refuse it.
"""
from __future__ import annotations

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.worker.channel.messages import Freeze

REASONS = ("drain", "rebalance")


class LiveMoves:
    async def Migrate(self, request: pb.MigrateRequest, context):
        if not self.wiring.moves_live:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is a {self.wiring.role.value} worker: "
                                "only a decode worker moves its generations live")
        if request.reason not in REASONS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reason must be one of {', '.join(REASONS)}, "
                                f"got {request.reason!r}")
        if request.count < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"count must be >= 0, got {request.count}")
        frozen, refused = await self._call_or_abort(context, Freeze(list(request.rids), request.all, request.count,
                                                                    request.reason))
        return pb.MigrateReply(frozen=frozen, refused=refused)
