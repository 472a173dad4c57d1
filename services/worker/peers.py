"""PrefillPeers: a decode worker's registrations with the prefill workers it pulls KV from.

Registration happens once per prefill address (at start-up for `--prefill`
addresses, else on first use): it checks compatibility and sets up the KV
transfer connection, so a mismatched pair fails here with the mismatch named.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import compat_to_proto
from pdserve.shared.compat import Compat

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class PeerError(RuntimeError):
    """A prefill worker could not be reached."""


class PeerRefused(PeerError):
    """A prefill worker refused us: the pair is incompatible."""


class PrefillPeers:
    def __init__(self, name: str, compat: Compat, transfer, timeout: float = 10.0) -> None:
        self.name = name
        self.compat = compat
        self.transfer = transfer
        self.timeout = timeout
        self._stubs: dict[str, pb_grpc.PrefillStub] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, addr: str) -> tuple[pb_grpc.PrefillStub, str]:
        """The stub for `addr`, registering first if needed; raises PeerError."""
        stub = self._stubs.get(addr)
        if stub is not None:
            return stub, self.name
        async with self._locks.setdefault(addr, asyncio.Lock()):
            if addr not in self._stubs:
                self._stubs[addr] = await self.register(addr)
        return self._stubs[addr], self.name

    async def register(self, addr: str) -> pb_grpc.PrefillStub:
        channel = grpc.aio.insecure_channel(addr, options=GRPC_OPTIONS)
        stub = pb_grpc.PrefillStub(channel)
        request = pb.RegisterRequest(peer_name=self.name, compat=compat_to_proto(self.compat),
                                     transfer_metadata=self.transfer.metadata())
        try:
            reply = await stub.Register(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            await channel.close()
            raise PeerError(f"cannot register with prefill worker {addr}: {exc.details() or exc.code().name}") from None
        if not reply.ok:
            await channel.close()
            raise PeerRefused(f"prefill worker {addr} refused registration: {reply.error}")
        log.info("registered with prefill worker %s", addr)
        return stub

    def forget(self, addr: str) -> None:
        """Drop a registration (the prefill worker restarted); the next use registers again."""
        self._stubs.pop(addr, None)

    async def register_all(self, addrs: list[str], deadline_s: float) -> None:
        """Register with every address, retrying unreachable ones until the deadline.

        A refusal (incompatible peer) raises at once: retrying cannot fix it.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        pending = list(addrs)
        while pending:
            addr = pending[0]
            try:
                await self.get(addr)
                pending.pop(0)
            except PeerRefused:
                raise
            except PeerError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.5)
