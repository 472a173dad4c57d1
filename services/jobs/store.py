"""Redis state of Files and Batches: the key layout, ids, and every transition the API makes.

All state lives in Redis; processes keep none that a restart would lose. Keys (prefix `pdserve:jobs:`):
  file:{id}           hash   the file object (id, bytes, created_at, filename, purpose, status)
  file:{id}:content   list   the bytes, in chunks of at most FILE_CHUNK (never one value per file)
  file:{id}:upload    list   chunks of a file being written (an upload, a batch's output): renamed to
                             `content` with the file object in one MULTI/EXEC, or deleted; expires if abandoned
  file:{id}:users     set    batches that read this file and are not yet terminal (blocks deletion)
  files, batches      zset   ids, all with score 0: ids sort by creation time, so BYLEX ranges paginate
  batch:{id}          hash   the batch object; `finalize_to` (first writer wins) names its terminal status,
                             `frozen` marks that no more item results are accepted
  batch:{id}:out|err  hash   custom_id -> "{input line index}\t{output line}": one entry per item, ever
  deadlines           zset   batch id -> expires_at, for the expiry sweep
  items, control      stream work for batch workers (consumer group `workers`): one entry per batch item;
                             batch-level tasks (validate, finalize)
Every multi-key change is one Lua script or one MULTI/EXEC, so a crash of any process (or of Redis, with
append-only persistence) never leaves half a transition behind.
"""
from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.services.jobs import scripts

PREFIX = "pdserve:jobs:"
FILE_CHUNK = 1 << 20  # bytes per Redis value of a file's content
UNFINISHED_TTL_S = 24 * 3600  # a file whose writer died mid-way is deleted by Redis after this long
GROUP = "workers"
TERMINAL = ("completed", "failed", "expired", "cancelled")


FILE_ID = "file-"  # prefixes of the ids this service issues
BATCH_ID = "batch_"
_STAMP_DIGITS, _RANDOM_BYTES = 14, 5
_ID_BODY = re.compile("[0-9a-f]{%d}" % (_STAMP_DIGITS + 2 * _RANDOM_BYTES))


def new_id(prefix: str) -> str:
    """`prefix` + 14 hex digits of microseconds + 10 random hex digits: ids of one kind sort by creation."""
    return f"{prefix}{time.time_ns() // 1000:0{_STAMP_DIGITS}x}{secrets.token_hex(_RANDOM_BYTES)}"


def is_id(value: object, prefix: str) -> bool:
    """Whether `value` has the exact form of `new_id(prefix)`: only such ids may become part of a Redis key."""
    return isinstance(value, str) and value.startswith(prefix) and _ID_BODY.fullmatch(value, len(prefix)) is not None


def now() -> int:
    return int(time.time())


class Keys:
    def __init__(self, prefix: str = PREFIX) -> None:
        self.prefix = prefix
        self.files = prefix + "files"
        self.batches = prefix + "batches"
        self.deadlines = prefix + "deadlines"
        self.items = prefix + "items"
        self.control = prefix + "control"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}"

    def content(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}:content"

    def upload(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}:upload"

    def users(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}:users"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}"

    def out(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}:out"

    def err(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}:err"


@dataclass(frozen=True)
class Page:
    ids: list[str]
    has_more: bool


def connect(url: str, *, decode: bool = True, retries: int = 3) -> aioredis.Redis:
    """A client that reconnects by itself; commands retry a few times while Redis restarts."""
    return aioredis.Redis.from_url(
        url, decode_responses=decode, socket_connect_timeout=2, socket_timeout=10, health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError])


class Store:
    """Files and batch records as the API sees them. `r` decodes to str; `raw` returns file bytes."""

    def __init__(self, url: str, retries: int = 3, prefix: str = PREFIX) -> None:
        self.r = connect(url, retries=retries)
        self.raw = connect(url, decode=False, retries=retries)
        self.k = Keys(prefix)
        self._create_batch = self.r.register_script(scripts.CREATE_BATCH)
        self._cancel = self.r.register_script(scripts.CANCEL_BATCH)
        self._delete_file = self.r.register_script(scripts.DELETE_FILE)

    async def close(self) -> None:
        await self.r.aclose()
        await self.raw.aclose()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    # ------------------------------------------------------------ files

    def writer(self, file_id: str) -> FileWriter:
        """Writes file `file_id` chunk by chunk; it exists for readers only once committed."""
        return FileWriter(self, file_id)

    async def put_file(self, file_id: str, filename: str, purpose: str, content: bytes) -> dict:
        """Store a small file held in memory (see `writer` for any other)."""
        writer = self.writer(file_id)
        await writer.start()
        await writer.write(content)
        return await writer.commit(filename, purpose)

    async def get_file(self, file_id: str) -> dict | None:
        meta = await self.r.hgetall(self.k.file(file_id))
        return meta or None

    async def get_files(self, file_ids: list[str]) -> list[dict]:
        async with self.r.pipeline(transaction=False) as pipe:
            for file_id in file_ids:
                pipe.hgetall(self.k.file(file_id))
            return [m for m in await pipe.execute() if m]

    async def file_content(self, file_id: str) -> bytes | None:
        """The whole content of a small file (tests, tools); None when there is no such file."""
        if not await self.r.exists(self.k.file(file_id)):
            return None
        return b"".join([chunk async for chunk in self.iter_content(file_id)])

    async def iter_content(self, file_id: str) -> AsyncIterator[bytes]:
        """The content of a stored file, one chunk at a time (nothing if there is none)."""
        key = self.k.content(file_id)
        if await self.r.type(key) == "string":  # written before files were chunked
            yield await self.raw.get(key) or b""
            return
        for index in range(await self.r.llen(key)):
            chunk = await self.raw.lindex(key, index)
            if chunk is None:  # deleted meanwhile
                return
            yield chunk

    async def delete_file(self, file_id: str) -> str:
        """'ok', 'missing', or 'in_use:{batch_id}' (a batch still reads it)."""
        return await self._delete_file(
            keys=[self.k.file(file_id), self.k.content(file_id), self.k.users(file_id), self.k.files],
            args=[file_id])

    # ------------------------------------------------------------ listing

    async def page(self, zkey: str, after: str | None, limit: int, descending: bool = True) -> Page:
        """Ids after the cursor `after` (which need not exist any more), newest first unless ascending."""
        if descending:
            hi, lo = (f"({after}" if after else "+"), "-"
            ids = await self.r.zrange(zkey, hi, lo, desc=True, bylex=True, offset=0, num=limit + 1)
        else:
            lo, hi = (f"({after}" if after else "-"), "+"
            ids = await self.r.zrange(zkey, lo, hi, bylex=True, offset=0, num=limit + 1)
        return Page(ids[:limit], len(ids) > limit)

    # ------------------------------------------------------------ batches

    async def create_batch(self, batch_id: str, input_file_id: str, fields: dict[str, str | int]) -> str:
        """Create a `validating` batch, mark its input file in use and queue its validation, atomically.

        Returns 'ok', 'missing' (no such file) or 'purpose:{purpose}' (not a batch input file)."""
        flat: list[str | int] = []
        for key, value in fields.items():
            flat += [key, value]
        return await self._create_batch(
            keys=[self.k.file(input_file_id), self.k.users(input_file_id), self.k.batch(batch_id),
                  self.k.batches, self.k.deadlines, self.k.control],
            args=[batch_id, fields["expires_at"], *flat])

    async def get_batch(self, batch_id: str) -> dict | None:
        """The batch hash, with live `completed`/`failed` counts while it runs."""
        [record] = await self.get_batches([batch_id])
        return record or None

    async def get_batches(self, batch_ids: list[str]) -> list[dict]:
        async with self.r.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hgetall(self.k.batch(batch_id))
                pipe.hlen(self.k.out(batch_id))
                pipe.hlen(self.k.err(batch_id))
            replies = await pipe.execute()
        records = []
        for record, done, failed in zip(replies[0::3], replies[1::3], replies[2::3]):
            if record and record["status"] not in TERMINAL:
                record["completed"], record["failed"] = done, failed
            records.append(record)
        return records

    async def cancel_batch(self, batch_id: str) -> str:
        """'cancelling'/'cancelled' (now or already), 'missing', or 'conflict:{status}'."""
        return await self._cancel(keys=[self.k.batch(batch_id), self.k.control], args=[batch_id, now()])


class FileWriter:
    """One file written in chunks of FILE_CHUNK bytes into a key of its own, then committed with its file object
    in one MULTI/EXEC (or discarded). Lifecycle: start -> write... -> commit | discard. Starting again drops
    what an earlier, interrupted attempt wrote, so a retried writer ends with the same file."""

    def __init__(self, store: Store, file_id: str) -> None:
        self.store, self.file_id = store, file_id
        self.key = store.k.upload(file_id)
        self.size = 0
        self._buffer = bytearray()
        self._pushed = False

    async def start(self) -> None:
        await self.store.r.delete(self.key)

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        self._buffer += data
        while len(self._buffer) >= FILE_CHUNK:
            await self._push(bytes(self._buffer[:FILE_CHUNK]))
            del self._buffer[:FILE_CHUNK]

    async def _push(self, chunk: bytes) -> None:
        async with self.store.r.pipeline(transaction=True) as pipe:
            pipe.rpush(self.key, chunk)
            pipe.expire(self.key, UNFINISHED_TTL_S)
            await pipe.execute()
        self._pushed = True

    async def commit(self, filename: str, purpose: str) -> dict:
        """The file and its object appear together; returns the object."""
        if self._buffer or not self._pushed:
            await self._push(bytes(self._buffer))  # an empty file is one empty chunk
            self._buffer.clear()
        k = self.store.k
        meta = {"id": self.file_id, "bytes": self.size, "created_at": now(), "filename": filename,
                "purpose": purpose, "status": "processed"}
        async with self.store.r.pipeline(transaction=True) as pipe:
            pipe.rename(self.key, k.content(self.file_id))
            pipe.persist(k.content(self.file_id))
            pipe.hset(k.file(self.file_id), mapping=meta)
            pipe.zadd(k.files, {self.file_id: 0})
            await pipe.execute()
        return meta

    async def discard(self) -> None:
        self._buffer.clear()
        await self.store.r.delete(self.key)


def dump(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
