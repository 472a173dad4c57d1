"""The batch runner of a `pdserve batch-worker` process: pulls batch items and control tasks from Redis and
runs them through the gateway.

Loops (one asyncio task each, all riding out Redis restarts):
- items:   read new item entries (and take over ones whose lease lapsed) up to `concurrency` in flight
- control: run validate/finalize tasks one at a time
- lease:   renew the lease on everything in flight, so live work is never taken over
- monitor: abort in-flight items of batches that were cancelled or expired, and acknowledge them
- sweep:   move batches past their deadline to `expired`; forget long-idle dead consumers
Invariant: an entry is acknowledged only after its result is recorded (same script) or when its batch no
longer accepts results. A worker killed at any point leaves its entries pending for another to finish.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.services import tracing
from pdserve.services.jobs import control
from pdserve.services.jobs.executor import Executor
from pdserve.services.jobs.store import Store
from pdserve.services.jobs.workqueue import Entry, ItemEntry, Queue

log = logging.getLogger("pdserve.jobs.worker")
T = TypeVar("T")
TRANSIENT = (RedisConnectionError, RedisTimeoutError)  # Redis down or restarting (loading its data counts)


@dataclass(frozen=True)
class RunnerSettings:
    concurrency: int = 32
    lease_s: float = 30.0  # a dead worker's items are taken over this long after its last renewal
    block_ms: int = 1000
    status_ttl_s: float = 0.5  # how stale a cached "batch still accepts results" answer may be
    redis_patience_s: float = 120.0  # how long a finished item waits for Redis before leaving it to a re-run
    drain_s: float = 3.0  # on shutdown, how long items in flight may still finish


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def item_from(entry: Entry) -> ItemEntry | None:
    f = entry.fields
    try:
        return ItemEntry(entry.id, f["b"], int(f["i"]), f["c"], f["u"], f["body"], f.get("t", ""))
    except (KeyError, ValueError):
        return None


class BatchRunner:
    def __init__(self, store: Store, executor: Executor, settings: RunnerSettings, name: str | None = None) -> None:
        self.store = store
        self.executor = executor
        self.settings = settings
        self.queue = Queue(store, name or consumer_name())
        self.inflight: dict[str, tuple[ItemEntry, asyncio.Task]] = {}
        self.control_inflight: set[str] = set()
        self.accepting: dict[str, tuple[bool, float]] = {}  # batch id -> (accepts results, when checked)
        self.slot_free = asyncio.Event()
        self.stop = asyncio.Event()
        self._last_scan: dict[str, float] = {}
        self._redis_down_since: float | None = None

    @property
    def lease_ms(self) -> int:
        return int(self.settings.lease_s * 1000)

    async def run(self) -> None:
        log.info("batch worker %s: concurrency %d, lease %.1f s", self.queue.consumer, self.settings.concurrency,
                 self.settings.lease_s)
        try:
            await self.with_redis(self.queue.ensure_groups)
            await self.with_redis(self.store.count_usage)  # before this worker writes output files counted in it
        except TRANSIENT:
            return  # stopped before Redis was ever reachable
        await self.executor.start()
        s = self.settings
        loops = [asyncio.create_task(self.loop(step, pause), name=step.__name__) for step, pause in (
            (self.items_step, 0.0), (self.control_step, 0.0), (self.lease_step, s.lease_s / 3),
            (self.monitor_step, s.status_ttl_s), (self.sweep_step, 1.0))]
        try:
            await self.stop.wait()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            # Let what is in flight finish briefly; the rest stays pending and is taken over after the lease.
            running = [t for _, t in self.inflight.values()]
            if running:
                await asyncio.wait(running, timeout=s.drain_s)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await self.executor.close()

    async def loop(self, step: Callable[[], Awaitable[None]], pause: float) -> None:
        while not self.stop.is_set():
            try:
                await step()
            except TRANSIENT as exc:
                self.redis_down(exc)
                await asyncio.sleep(0.5)
                continue
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    # Redis lost its data (restarted without persistence): recreate the groups and go on.
                    log.warning("consumer group missing; recreating it")
                    with contextlib.suppress(RedisError):
                        await self.queue.ensure_groups()
                else:
                    log.error("batch worker step %s: redis refused a command: %s", step.__name__, exc)
                    await asyncio.sleep(1.0)
            except Exception:
                log.exception("batch worker step %s failed", step.__name__)
                await asyncio.sleep(1.0)
            if pause:
                await asyncio.sleep(pause)

    def redis_down(self, exc: Exception) -> None:
        if self._redis_down_since is None:
            self._redis_down_since = time.monotonic()
            log.warning("redis unavailable (%s); retrying", exc)

    def redis_up(self) -> None:
        if self._redis_down_since is not None:
            log.info("redis available again after %.1f s", time.monotonic() - self._redis_down_since)
            self._redis_down_since = None

    async def with_redis(self, op: Callable[[], Awaitable[T]], patience_s: float | None = None) -> T:
        """`op()`, retried while Redis is unreachable (for up to `patience_s`, if given)."""
        start, delay = time.monotonic(), 0.1
        while True:
            try:
                result = await op()
                self.redis_up()
                return result
            except TRANSIENT as exc:
                self.redis_down(exc)
                if self.stop.is_set() or (patience_s is not None and time.monotonic() - start > patience_s):
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------ items

    def scan_due(self, kind: str, every_s: float | None = None) -> bool:
        """Rate-limits periodic scans: true at most once per `every_s` (default: half a lease) per kind."""
        now = time.monotonic()
        if now - self._last_scan.get(kind, -1e9) < (every_s or self.settings.lease_s / 2):
            return False
        self._last_scan[kind] = now
        return True

    async def batch_accepts(self, batch_ids: set[str]) -> dict[str, bool]:
        now = time.monotonic()
        stale = [b for b in batch_ids if now - self.accepting.get(b, (False, -1e9))[1] > self.settings.status_ttl_s]
        if stale:
            for b, ok in (await self.queue.batch_states(stale)).items():
                self.accepting[b] = (ok, now)
        return {b: self.accepting[b][0] for b in batch_ids}

    async def items_step(self) -> None:
        free = self.settings.concurrency - len(self.inflight)
        if free <= 0:
            self.slot_free.clear()
            try:
                await asyncio.wait_for(self.slot_free.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            return
        q = self.queue
        entries = await q.claim_stale(q.k.items, self.lease_ms, free) if self.scan_due("items") else []
        entries = entries or await q.read(q.k.items, free, self.settings.block_ms)
        self.redis_up()
        entries = [e for e in entries if e.id not in self.inflight]
        items = [item_from(e) for e in entries]
        broken = [e.id for e, item in zip(entries, items) if item is None]
        if broken:
            log.warning("dropping %d malformed item entries: %s", len(broken), broken[:5])
        items = [i for i in items if i is not None]
        accepts = await self.batch_accepts({i.batch_id for i in items})
        await q.ack(q.k.items, broken + [i.id for i in items if not accepts[i.batch_id]])
        for item in items:
            if accepts[item.batch_id]:
                self.inflight[item.id] = (item, asyncio.create_task(self.run_item(item)))

    async def run_item(self, item: ItemEntry) -> None:
        try:
            if not await self.with_redis(lambda: self.queue.should_run(item), self.settings.redis_patience_s):
                await self.with_redis(lambda: self.queue.ack(self.queue.k.items, [item.id]))
                return
            with tracing.batch_item(item.batch_id, item.custom_id, item.url, item.trace) as traceparent:
                outcome = await self.executor.run(item.url, item.body, traceparent)
            line = outcome.line(item.custom_id)
            await self.with_redis(lambda: self.queue.record(item, outcome.ok, line), self.settings.redis_patience_s)
        except TRANSIENT:
            log.warning("item %s of batch %s: redis unavailable too long; it will run again", item.custom_id,
                        item.batch_id)
        except Exception:
            log.exception("item %s of batch %s failed; it will run again", item.custom_id, item.batch_id)
        finally:
            self.inflight.pop(item.id, None)
            self.slot_free.set()

    async def monitor_step(self) -> None:
        """Abort what is in flight for batches that stopped accepting results (cancelled, expired)."""
        batch_ids = {item.batch_id for item, _ in self.inflight.values()}
        if not batch_ids:
            return
        accepts = await self.batch_accepts(batch_ids)
        dropped = [(item, task) for item, task in list(self.inflight.values()) if not accepts[item.batch_id]]
        for _, task in dropped:
            task.cancel()
        if dropped:
            await self.queue.ack(self.queue.k.items, [item.id for item, _ in dropped])
            log.info("aborted %d in-flight items of stopped batches", len(dropped))

    async def lease_step(self) -> None:
        await self.queue.renew(self.queue.k.items, list(self.inflight))
        await self.queue.renew(self.queue.k.control, list(self.control_inflight))

    # ------------------------------------------------------------ batch tasks

    async def control_step(self) -> None:
        q = self.queue
        entries = await q.claim_stale(q.k.control, self.lease_ms, 1) if self.scan_due("control") else []
        for entry in entries or await q.read(q.k.control, 1, self.settings.block_ms):
            self.control_inflight.add(entry.id)
            try:
                await self.with_redis(lambda: control.run_task(self.store, q, entry.fields))
                await self.with_redis(lambda: q.ack(q.k.control, [entry.id]))
            finally:
                self.control_inflight.discard(entry.id)

    async def sweep_step(self) -> None:
        for batch_id in await self.queue.due_for_expiry():
            if await self.queue.expire(batch_id):
                log.info("batch %s passed its completion window; expiring", batch_id)
        if self.scan_due("consumers", every_s=300.0):
            await self.queue.forget_idle_consumers(idle_ms=3600_000)
            horizon = time.monotonic() - 300.0
            self.accepting = {b: v for b, v in self.accepting.items() if v[1] > horizon}
