"""What the workers say their prefix caches hold, for the router: `HeldPrefixes` is the table, `CacheFeeds` keeps
it filled from each worker's KVEvents stream (services/worker/front/kv_events_rpc.py).

Device and host-memory pages are a worker's own. Stored pages belong to a storage domain: the workers whose storage
tiers share a directory and the KV identity name it alike, and any of them reads a page another stored. A worker's
stream starts with everything it holds; when it ends (the worker stopped, restarted, or the connection broke) what
the worker held on its device and in its host memory is forgotten, and the stream is opened again while the worker is healthy.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.gateway.workers.pool import Worker, WorkerPool
from pdserve.shared.kv_events import DEVICE, HOST, STORAGE, STORAGE_LIMIT

log = logging.getLogger("pdserve.gateway")
RETRY_S = 2.0  # after a stream broke while its worker stayed healthy


class HeldPrefixes:
    def __init__(self, storage_limit: int = STORAGE_LIMIT) -> None:
        self.device: dict[str, set[int]] = {}  # address -> page hashes in its pool
        self.host: dict[str, set[int]] = {}  # address -> page hashes in its host-memory tier
        self.storage: dict[str, OrderedDict[int, None]] = {}  # domain -> page hashes stored there
        self.domain_of: dict[str, str] = {}  # address -> its storage domain
        self.storage_limit = storage_limit

    def apply(self, address: str, batch: pb.KVEventBatch) -> list[int]:
        """Take one message of `address`'s stream; the device pages it says the worker no longer holds."""
        device = self.device.setdefault(address, set())
        host = self.host.setdefault(address, set())
        if batch.snapshot or DEVICE in batch.cleared:
            device.clear()
        if batch.snapshot or HOST in batch.cleared:
            host.clear()
        domain = batch.storage_domain
        if domain:
            self.domain_of[address] = domain
        else:
            self.domain_of.pop(address, None)
        device.update(batch.device_added)
        device.difference_update(batch.device_removed)
        host.update(batch.host_added)
        host.difference_update(batch.host_removed)
        if domain:
            stored = self.storage.setdefault(domain, OrderedDict())
            if STORAGE in batch.cleared:
                stored.clear()
            for h in batch.storage_added:
                stored[h] = None
                stored.move_to_end(h)
            for h in batch.storage_removed:
                stored.pop(h, None)
            while len(stored) > self.storage_limit:
                stored.popitem(last=False)
        for gone in set(self.storage) - set(self.domain_of.values()):  # a domain no worker is in any more
            del self.storage[gone]
        return list(batch.device_removed)

    def forget(self, address: str) -> None:
        self.device.pop(address, None)
        self.host.pop(address, None)
        self.domain_of.pop(address, None)
        for gone in set(self.storage) - set(self.domain_of.values()):
            del self.storage[gone]

    def pages(self, address: str, hashes: list[int]) -> tuple[int, int, int]:
        """How many of the prompt's first pages (`hashes`) the worker holds on its device, on its device or in
        its host memory (the pool evicts a prefix's last pages first, so its start may be in one and the rest in
        the other), and in its storage."""
        device, host = self.device.get(address, set()), self.host.get(address, set())
        return (_longest(hashes, device), _longest(hashes, device, host),
                _longest(hashes, self.storage.get(self.domain_of.get(address, ""), ())))


def _longest(hashes: list[int], *tiers) -> int:
    for pages in range(len(hashes), 0, -1):
        if any(hashes[pages - 1] in held for held in tiers):
            return pages
    return 0


class CacheFeeds:
    """One KVEvents stream per healthy worker that holds a prefix cache, applied to the router's tables."""

    def __init__(self, pool: WorkerPool, router) -> None:
        self.pool, self.router = pool, router
        self._tasks: dict[str, asyncio.Task] = {}
        pool.on_rejoin.append(self._follow)

    def _follow(self, address: str) -> None:
        task = self._tasks.get(address)
        if task is None or task.done():
            self._tasks[address] = asyncio.get_running_loop().create_task(self._read(address),
                                                                          name=f"kv-events {address}")

    async def _read(self, address: str) -> None:
        while True:
            worker: Worker | None = self.pool.workers.get(address)
            if worker is None or not worker.healthy:
                break
            try:
                async for batch in worker.stub.KVEvents(pb.KVEventsRequest()):
                    self.router.learn(address, batch)
                break  # ended by the worker: it tells nothing (no prefix cache)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a worker that does not stream its events
                    break
                log.debug("KV events of %s ended (%s): again in %.0f s", address, exc.code().name, RETRY_S)
            finally:
                self.router.held.forget(address)
            await asyncio.sleep(RETRY_S)
        self._tasks.pop(address, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
