"""The worker's cache events, for the routers: what its prefix cache holds in which tier, kept up to date from the
engine's events (shared/kv_events.py) and streamed to each router that calls KVEvents.

A subscriber gets everything held first (a snapshot, in chunks), then each engine iteration's changes. One that
falls behind by more than QUEUE_LIMIT batches is not waited for: its backlog is dropped and it gets a fresh
snapshot instead, so a slow router never holds memory or the event loop here.
"""
from __future__ import annotations

import asyncio
from collections import deque

from pdserve.proto import worker_pb2 as pb
from pdserve.shared.kv_events import DEVICE, HOST, STORAGE, HeldPages

QUEUE_LIMIT = 256  # batches a subscriber may have waiting before it is sent a snapshot instead
CHUNK = 50_000  # hashes per tier in one message of a snapshot
IDLE_CHECK_S = 30.0  # a stream with nothing to send looks at whether its client is still there this often


class _Subscriber:
    def __init__(self) -> None:
        self.queue: deque[pb.KVEventBatch] = deque()
        self.wake = asyncio.Event()
        self.resync = True  # the next message is a snapshot


class KVFeed:
    """Owned by the worker's front: the engine's "kv" events go in (`apply`), every subscriber's stream comes out."""

    def __init__(self) -> None:
        self.held = HeldPages()
        self.domain = ""  # the storage tier's (KVFiles' domain), "" without one
        self._subscribers: set[_Subscriber] = set()

    def apply(self, cleared: list[str], added: dict[str, list[int]], removed: dict[str, list[int]]) -> None:
        self.held.apply(cleared, added, removed)
        if not self._subscribers:
            return
        batch = pb.KVEventBatch(cleared=cleared, device_added=added.get(DEVICE, ()),
                                device_removed=removed.get(DEVICE, ()), host_added=added.get(HOST, ()),
                                host_removed=removed.get(HOST, ()), storage_added=added.get(STORAGE, ()),
                                storage_removed=removed.get(STORAGE, ()), storage_domain=self.domain)
        for sub in self._subscribers:
            if len(sub.queue) >= QUEUE_LIMIT:
                sub.queue.clear()
                sub.resync = True
            elif not sub.resync:
                sub.queue.append(batch)
            sub.wake.set()

    def set_domain(self, domain: str) -> None:
        """The storage tier moved (a weight update starts a new identity): every subscriber starts over."""
        self.domain = domain
        for sub in self._subscribers:
            sub.queue.clear()
            sub.resync = True
            sub.wake.set()

    def snapshot(self) -> list[pb.KVEventBatch]:
        device, host, storage = list(self.held.device), list(self.held.host), list(self.held.storage)
        chunks = max(1, *(-(-len(held) // CHUNK) for held in (device, host, storage)))
        return [pb.KVEventBatch(snapshot=i == 0, device_added=device[i * CHUNK:(i + 1) * CHUNK],
                                host_added=host[i * CHUNK:(i + 1) * CHUNK],
                                storage_added=storage[i * CHUNK:(i + 1) * CHUNK], storage_domain=self.domain)
                for i in range(chunks)]

    async def stream(self, context):
        """KVEvents' messages for one subscriber, until its call ends."""
        sub = _Subscriber()
        self._subscribers.add(sub)
        try:
            while not context.done():
                if sub.resync:
                    sub.resync = False
                    sub.queue.clear()
                    for batch in self.snapshot():
                        yield batch
                while sub.queue and not sub.resync:
                    yield sub.queue.popleft()
                sub.wake.clear()
                if not sub.queue and not sub.resync:
                    try:
                        await asyncio.wait_for(sub.wake.wait(), IDLE_CHECK_S)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self._subscribers.discard(sub)


class KVEventsRpc:
    """A mixin of rpc.WorkerService: the KVEvents stream of its `kv_feed`."""

    kv_feed: KVFeed | None = None

    async def KVEvents(self, request: pb.KVEventsRequest, context):
        if self.kv_feed is None:  # an embedding worker: no prefix cache
            return
        async for batch in self.kv_feed.stream(context):
            yield batch
