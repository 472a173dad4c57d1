"""The Worker service's operator RPCs: what the worker serves (Info, with its LoRA adapters), loading and
unloading adapters, the expert distribution record, load and pool figures, flushing the prefix cache.

Each is one engine call (`engine_admin_calls.AdminCalls` on the engine's side) whose answer becomes the reply;
none touches a generation in progress, but SwitchRole (front/role_switch.py), which drains them first. A mixin of `rpc.WorkerService`, over its `info` and two ways to call
the engine: `_engine` (failures raised) and `_call_or_abort` (a failure ends the gRPC call with its status).
"""
from __future__ import annotations

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.worker.channel.wire import RemoteError
from pdserve.services.worker.channel.messages import (Adapters, Call, Experts, FlushCache, Load, LoadAdapter,
                                                     PoolStats, UnloadAdapter)


class AdminRpcs:
    async def Info(self, request, context):
        reply = pb.InfoReply()
        reply.CopyFrom(self.info)
        reply.lora_adapters.extend(adapter_info(a) for a in await self._call_or_abort(context, Adapters()))
        return reply

    async def Load(self, request, context):
        return pb.LoadReply(**await self._call_or_abort(context, Load()))

    async def FlushCache(self, request: pb.FlushRequest, context):
        # Waits up to engine_admin_calls.FLUSH_WRITES_WAIT_S for the storage tier's writes, beyond the usual call.
        return pb.FlushReply(**await self._call_or_abort(context, FlushCache(list(request.tiers))))

    async def Stats(self, request, context):
        return pb.PoolStats(**await self._call_or_abort(context, PoolStats()))

    # ------------------------------------------------------------ LoRA adapters
    async def LoadLoraAdapter(self, request: pb.LoadLoraRequest, context):
        # Loading reads and checks the files on the engine thread: adapters are megabytes, not a step's worth.
        return await self._change_adapters(context, LoadAdapter(request.name, request.path))

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraRequest, context):
        return await self._change_adapters(context, UnloadAdapter(request.name))

    async def _change_adapters(self, context, call: Call) -> pb.LoraReply:
        try:
            return pb.LoraReply(ok=True, adapters=[adapter_info(a) for a in await self._engine(call)])
        except RemoteError as exc:  # the message names the adapter and the problem
            if exc.kind not in ("invalid", "weights"):
                raise
            error = str(exc)
        adapters = await self._call_or_abort(context, Adapters())
        return pb.LoraReply(ok=False, error=error, adapters=[adapter_info(a) for a in adapters])

    # ------------------------------------------------------------ expert distribution
    async def StartExpertRecord(self, request, context):
        await self._expert_call(context, "start")
        return pb.ExpertRecordReply(recording=True)

    async def StopExpertRecord(self, request, context):
        await self._expert_call(context, "stop")
        return pb.ExpertRecordReply(recording=False)

    async def DumpExpertRecord(self, request, context):
        dump = await self._expert_call(context, "dump")  # counts [L, E], flattened
        return pb.ExpertDumpReply(counts=dump["counts"], shape=dump["shape"], path=dump["path"])

    async def _expert_call(self, context, op: str):
        """The reason a worker cannot record (no experts, no mode) as FAILED_PRECONDITION; a dump that cannot be
        written as INTERNAL."""
        try:
            return await self._engine(Experts(op))
        except RemoteError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION if exc.kind == "precondition"
                                else grpc.StatusCode.INTERNAL, str(exc))


    # ------------------------------------------------------------ live role switch
    async def SwitchRole(self, request: pb.SwitchRoleRequest, context):
        switch = getattr(self, "role_switch", None)  # front/role_switch.py, set by the app
        if switch is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker does not switch roles")
        return await switch(request, context)


def adapter_info(adapter: dict) -> pb.LoraAdapterInfo:
    return pb.LoraAdapterInfo(**adapter)
