"""PrefillPeers: a decode worker's registrations with the prefill workers it pulls KV from.

Registration checks compatibility and sets up the KV transfer connection, so a mismatched pair fails
there with the mismatch named. Lifecycle of one prefill address:
- registered at start-up (`--prefill` addresses) or on first use;
- kept: every `refresh_s` a background task registers again. Registering is idempotent on the prefill
  side, so this costs one small RPC, and a prefill worker that restarted (and so forgot us) has us back
  within about a second, without anything else restarting;
- a Prefill call refused in between because we are not registered registers at once and is sent again;
- an address that stops answering leaves the registered set (logged once) until it answers again, and is
  no longer tried after `FORGET_AFTER_S` (a prefill worker scaled away); a refusal (incompatible peer) is
  logged and raised to the caller.
Each registration is also a round trip that tells the prefill worker's clock (`PeerClock`), which bounds the
leases of the fences its writes carry (shared/transfer/fence.py): every send of a Prefill call stamps its lease.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import compat_to_proto
from pdserve.shared.compat import Compat
from pdserve.shared.cluster_auth import worker_channel
from pdserve.shared.transfer.fence import Lease, PeerClock

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
# The worker's server pings its callers: a gateway whose host vanished (no FIN) ends its streams within half a
# minute, instead of after TCP's two hours while its generations run on holding pages.
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)]
# A restarted prefill worker must be reached again within a second, not after gRPC's backoff of up to 2 min.
CHANNEL_OPTIONS = GRPC_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
                                  ("grpc.max_reconnect_backoff_ms", 1_000)]
REFRESH_S = 1.0  # between two registrations with the same prefill worker
# A restarted prefill worker is routed to as soon as it answers the gateway, maybe while our channel to it still
# backs off after failed attempts (gRPC fails calls at once meanwhile): registering waits that long for it.
RECONNECT_WAIT_S = 1.5
REFRESH_TIMEOUT_S = 2.0  # for one background registration: a hung peer must not hold its lock for long
FORGET_AFTER_S = 300.0  # an address that has not answered this long is dropped (used again, it starts over)


class PeerError(RuntimeError):
    """A prefill worker could not be reached."""


class PeerRefused(PeerError):
    """A prefill worker refused us: the pair is incompatible."""


class PrefillClient:
    """Prefill calls to one registered prefill worker.

    A call refused with FAILED_PRECONDITION (the worker does not know us: it restarted since we registered)
    registers again and is sent once more, so a request never fails for a registration it could renew.
    """

    def __init__(self, peers: PrefillPeers, addr: str, stub: pb_grpc.PrefillStub) -> None:
        self._peers = peers
        self._addr = addr
        self._stub = stub

    async def Prefill(self, request: pb.PrefillRequest, timeout: float,  # noqa: N802 (stub's name)
                      lease: Lease | None = None) -> pb.PrefillReply:
        """`lease`: the reservation's, stamped (in `request.fence_deadline`) with the clock of each send."""
        try:
            return await self._send(request, timeout, lease)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.info("prefill worker %s does not know us (%s): registering again", self._addr, exc.details())
        await self._peers.register(self._addr)  # the same channel: our stub stays valid
        return await self._send(request, timeout, lease)

    async def _send(self, request: pb.PrefillRequest, timeout: float, lease: Lease | None) -> pb.PrefillReply:
        if lease is not None:
            request.fence_deadline = lease.stamp(self._peers.clocks[self._addr])
        return await self._stub.Prefill(request, timeout=timeout)

    async def Fence(self, request: pb.FenceRequest, timeout: float) -> pb.FenceReply:  # noqa: N802 (stub's name)
        """On the channel the Prefill call took: the prefill worker reads the call (or its cancellation) first."""
        return await self._stub.Fence(request, timeout=timeout)


class PrefillPeers:
    def __init__(self, name: str, compat: Compat, metadata: bytes, timeout: float = 10.0,
                 refresh_s: float = REFRESH_S) -> None:
        """`metadata`: what a prefill worker needs to write into our KV pool (the transfer agent's), the same
        bytes every time, so that registering again changes nothing there."""
        self.name = name
        self.compat = compat
        self.timeout = timeout
        self.refresh_s = refresh_s
        self._channels: dict[str, grpc.aio.Channel] = {}  # every address ever used, registered or not
        self._clients: dict[str, PrefillClient] = {}  # the addresses we are registered with now
        self._locks: dict[str, asyncio.Lock] = {}
        self._answered_at: dict[str, float] = {}  # loop time of each address's last registration (or first try)
        self._metadata = metadata
        self._keeper: asyncio.Task | None = None
        self.clocks: dict[str, PeerClock] = {}  # address -> its clock, as of its latest registration

    async def get(self, addr: str) -> tuple[PrefillClient, str]:
        """The client for `addr`, registering first if needed; raises PeerError."""
        client = self._clients.get(addr)
        if client is None:
            client = await self.register(addr)
        return client, self.name

    async def register(self, addr: str, timeout: float | None = None) -> PrefillClient:
        """Register with `addr` now (again if we were already); raises PeerError, PeerRefused."""
        self._keep_registered()
        async with self._locks.setdefault(addr, asyncio.Lock()):
            channel = self._channel(addr)
            await self._wait_out_backoff(channel, min(RECONNECT_WAIT_S, timeout or self.timeout))
            stub = pb_grpc.PrefillStub(channel)
            try:
                sent = time.monotonic()
                reply = await stub.Register(self._request(), timeout=timeout or self.timeout)
            except grpc.aio.AioRpcError as exc:
                error = f"cannot register with prefill worker {addr}: {exc.details() or exc.code().name}"
                self._lose(addr, error)
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # another cluster's token, or none: final
                    raise PeerRefused(error) from None
                raise PeerError(error) from None
            if not reply.ok:
                error = f"prefill worker {addr} refused registration: {reply.error}"
                self._lose(addr, error)
                raise PeerRefused(error)
            self._answered_at[addr] = asyncio.get_running_loop().time()
            self.clocks[addr] = PeerClock(sent, reply.clock, time.monotonic())
            if addr not in self._clients:
                log.info("registered with prefill worker %s", addr)
                self._clients[addr] = PrefillClient(self, addr, stub)
            return self._clients[addr]

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

    async def close(self) -> None:
        """Stop registering (the worker is no decode worker any more) and close every channel."""
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
        channels, self._channels = list(self._channels.values()), {}
        self._clients.clear()
        self._answered_at.clear()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    # ------------------------------------------------------------ internals
    def _channel(self, addr: str) -> grpc.aio.Channel:
        # One channel per address for the worker's life: registering again must not open a connection each time.
        if addr not in self._channels:
            self._channels[addr] = worker_channel(addr, options=CHANNEL_OPTIONS)
            self._answered_at[addr] = asyncio.get_running_loop().time()
        return self._channels[addr]

    @staticmethod
    async def _wait_out_backoff(channel: grpc.aio.Channel, limit: float) -> None:
        """After failed connection attempts, give the channel's next one (within its 1 s backoff) up to `limit`
        seconds: a peer that is back is reached then; one still down fails the call that follows."""
        if channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return
        try:
            await asyncio.wait_for(channel.channel_ready(), limit)
        except TimeoutError:
            pass

    def _request(self) -> pb.RegisterRequest:
        return pb.RegisterRequest(peer_name=self.name, compat=compat_to_proto(self.compat),
                                  transfer_metadata=self._metadata)

    def _lose(self, addr: str, error: str) -> None:
        if self._clients.pop(addr, None) is not None:
            log.warning("%s (registration lost: trying again every %g s)", error, self.refresh_s)

    def _keep_registered(self) -> None:
        if self._keeper is None:  # started by the first registration, on the serving loop
            self._keeper = asyncio.get_running_loop().create_task(self._refresh_loop(), name="prefill-peers")

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.refresh_s)
            for addr in [a for a, t in self._answered_at.items() if loop.time() - t > FORGET_AFTER_S]:
                await self._drop(addr)
            results = await asyncio.gather(*(self.register(a, min(self.timeout, REFRESH_TIMEOUT_S))
                                             for a in list(self._channels)), return_exceptions=True)
            for result in results:  # PeerErrors were logged when a registration was lost
                if isinstance(result, Exception) and not isinstance(result, PeerError):
                    log.error("registering again with a prefill worker failed: %r", result)

    async def _drop(self, addr: str) -> None:
        log.info("prefill worker %s has not answered for %g s: no longer trying it", addr, FORGET_AFTER_S)
        self._clients.pop(addr, None)
        self._answered_at.pop(addr, None)
        channel = self._channels.pop(addr, None)
        if channel is not None:
            await channel.close()
