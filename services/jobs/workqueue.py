"""Work queues of the batch workers: two Redis streams read through one consumer group.

An entry stays pending, owned by the worker that read it, until that worker acknowledges it (an item's
entry is acknowledged by the same script that records its result). A worker renews the lease on what it
is running (`renew`); entries whose lease lapsed, because their worker died or lost Redis for too long,
are taken over by any worker (`claim_stale`). Results are recorded once per custom_id, so an item that
runs twice still appears once in the output.
"""
from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import ResponseError

from pdserve.services.jobs import scripts
from pdserve.services.jobs.store import GROUP, Store, now


@dataclass(frozen=True)
class Entry:
    id: str
    fields: dict[str, str]


@dataclass(frozen=True)
class ItemEntry:
    id: str
    batch_id: str
    index: int
    custom_id: str
    url: str
    body: str  # the request body, JSON text
    trace: str = ""  # W3C traceparent of the request that created the batch ("" when it was not traced)


class Queue:
    """Stream reads, leases and the item/finalize transitions a batch worker makes."""

    def __init__(self, store: Store, consumer: str) -> None:
        self.r = store.r
        self.k = store.k
        self.consumer = consumer
        self._claim_cursor = {self.k.items: "0-0", self.k.control: "0-0"}
        self._record = self.r.register_script(scripts.RECORD_RESULT)
        self._expire = self.r.register_script(scripts.EXPIRE_BATCH)
        self._freeze = self.r.register_script(scripts.FREEZE)
        self._finish = self.r.register_script(scripts.FINISH)

    async def ensure_groups(self) -> None:
        for stream in (self.k.items, self.k.control):
            try:
                await self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, stream: str, count: int, block_ms: int) -> list[Entry]:
        reply = await self.r.xreadgroup(GROUP, self.consumer, {stream: ">"}, count=count, block=block_ms)
        return [Entry(i, f) for _, entries in reply or [] for i, f in entries if f is not None]

    async def claim_stale(self, stream: str, lease_ms: int, count: int) -> list[Entry]:
        """Take over entries idle for longer than the lease, scanning the pending list a page per call."""
        cursor, entries, _deleted = await self.r.xautoclaim(stream, GROUP, self.consumer, lease_ms,
                                                            self._claim_cursor[stream], count=count)
        self._claim_cursor[stream] = cursor
        return [Entry(i, f) for i, f in entries if f is not None]

    async def renew(self, stream: str, entry_ids: list[str]) -> None:
        if entry_ids:
            await self.r.xclaim(stream, GROUP, self.consumer, 0, entry_ids, justid=True)

    async def ack(self, stream: str, entry_ids: list[str]) -> None:
        if entry_ids:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.xack(stream, GROUP, *entry_ids)
                pipe.xdel(stream, *entry_ids)
                await pipe.execute()

    # ------------------------------------------------------------ items

    async def batch_states(self, batch_ids: list[str]) -> dict[str, bool]:
        """Whether each batch still accepts new item results (in progress and not being finalized)."""
        async with self.r.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hmget(self.k.batch(batch_id), "status", "finalize_to")
            replies = await pipe.execute()
        return {b: status == "in_progress" and to is None for b, (status, to) in zip(batch_ids, replies)}

    async def should_run(self, item: ItemEntry) -> bool:
        """Checked right before an item is sent: its batch accepts results and it has none yet."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.hmget(self.k.batch(item.batch_id), "status", "finalize_to")
            pipe.hexists(self.k.out(item.batch_id), item.custom_id)
            pipe.hexists(self.k.err(item.batch_id), item.custom_id)
            (status, finalize_to), in_out, in_err = await pipe.execute()
        return status == "in_progress" and finalize_to is None and not (in_out or in_err)

    async def record(self, item: ItemEntry, ok: bool, line: str) -> bool:
        b = item.batch_id
        recorded = await self._record(
            keys=[self.k.batch(b), self.k.out(b), self.k.err(b), self.k.items, self.k.control],
            args=[item.custom_id, f"{item.index}\t{line}", "1" if ok else "0", item.id, GROUP, now(), b])
        return bool(recorded)

    # ------------------------------------------------------------ batch transitions

    async def due_for_expiry(self, limit: int = 100) -> list[str]:
        return await self.r.zrangebyscore(self.k.deadlines, "-inf", now(), start=0, num=limit)

    async def expire(self, batch_id: str) -> bool:
        return bool(await self._expire(keys=[self.k.batch(batch_id), self.k.deadlines, self.k.control],
                                       args=[batch_id]))

    async def freeze(self, batch_id: str, output_id: str, error_id: str) -> tuple[str, str, str] | None:
        reply = await self._freeze(keys=[self.k.batch(batch_id)], args=[output_id, error_id])
        return tuple(reply) if reply else None

    async def results_of(self, batch_id: str, custom_ids: list[str]) -> tuple[list[str], list[str]]:
        """The recorded output and error lines of `custom_ids`, in that order (those without one left out)."""
        if not custom_ids:
            return [], []
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.hmget(self.k.out(batch_id), custom_ids)
            pipe.hmget(self.k.err(batch_id), custom_ids)
            out, err = await pipe.execute()
        # Each value is "{input index}\t{line}" (see RECORD_RESULT).
        return ([v.split("\t", 1)[1] for v in out if v is not None],
                [v.split("\t", 1)[1] for v in err if v is not None])

    async def finish(self, batch_id: str, input_file_id: str, output_id: str | None, error_id: str | None) -> bool:
        b = batch_id
        return bool(await self._finish(
            keys=[self.k.batch(b), self.k.users(input_file_id), self.k.deadlines, self.k.out(b), self.k.err(b)],
            args=[b, now(), output_id or "", error_id or ""]))

    async def forget_idle_consumers(self, idle_ms: int) -> int:
        """Drop consumers (dead workers) that own nothing and were idle long: the group's bookkeeping."""
        dropped = 0
        for stream in (self.k.items, self.k.control):
            for consumer in await self.r.xinfo_consumers(stream, GROUP):
                if consumer["pending"] == 0 and consumer["idle"] > idle_ms and consumer["name"] != self.consumer:
                    await self.r.xgroup_delconsumer(stream, GROUP, consumer["name"])
                    dropped += 1
        return dropped
