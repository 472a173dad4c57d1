"""Redis state of Files and Batches: the key layout, ids, and every transition the API makes.

All state lives in Redis; processes keep none that a restart would lose. Keys (prefix `pdserve:jobs:`):
  file:{id}           hash   the file object (id, bytes, created_at, filename, purpose, status, expires_at)
  file:{id}:content   list   the bytes, in chunks of at most FILE_CHUNK (never one value per file)
  file:{id}:upload    list   chunks of a file being written (an upload, a batch's output): renamed to
                             `content` with the file object in one script, or deleted; released if abandoned
  file:{id}:users     set    batches that read this file and are not yet terminal (blocks deletion)
  files, batches      zset   ids, all with score 0: ids sort by creation time, so BYLEX ranges paginate
  usage               string bytes of all files plus those unfinished writers wrote: what the quota limits
  reserved            hash   file id -> bytes an unfinished writer wrote (counted in `usage`)
  uploads             zset   file id -> when an unfinished writer's bytes are released if it stops writing
  expiries            zset   file id -> when the expiry sweep looks at it (its `expires_at`, or later while a
                             batch still reads it); an expired file is gone for clients at once
  batch:{id}          hash   the batch object; `finalize_to` (first writer wins) names its terminal status,
                             `frozen` marks that no more item results are accepted
  batch:{id}:out|err  hash   custom_id -> "{input line index}\t{output line}": one entry per item, ever
  batch:{id}:ids:{run} hash  custom_id (or its digest) -> first line, while one validation run checks uniqueness
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
UNFINISHED_TTL_S = 24 * 3600  # a file whose writer died mid-way is released (and deleted) after this long
SWEEP_BATCH = 100  # files (or abandoned uploads) one sweep step removes at most
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
        self.usage = prefix + "usage"
        self.reserved = prefix + "reserved"
        self.uploads = prefix + "uploads"
        self.expiries = prefix + "expiries"

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

    def ids(self, batch_id: str, run: str) -> str:
        return f"{self.prefix}batch:{batch_id}:ids:{run}"

    def upload_keys(self, file_id: str) -> list[str]:
        """The keys of the unfinished-writer scripts (PUSH_CHUNK, RELEASE_UPLOAD)."""
        return [self.usage, self.reserved, self.uploads, self.upload(file_id)]


class TooManyFiles(Exception):
    """A file was refused: the deployment already holds `limit` files."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} files are stored")
        self.limit = limit


class QuotaExceeded(Exception):
    """A file was refused: storing it would pass the quota. `used`: what other files (and uploads) take;
    `needed`: the least this file needs."""

    def __init__(self, used: int, quota: int, needed: int) -> None:
        super().__init__(f"{used} of {quota} bytes used; {needed} more needed")
        self.used, self.quota, self.needed = used, quota, needed


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
        self._push_chunk = self.r.register_script(scripts.PUSH_CHUNK)
        self._release_upload = self.r.register_script(scripts.RELEASE_UPLOAD)
        self._commit_file = self.r.register_script(scripts.COMMIT_FILE)
        self._count_usage = self.r.register_script(scripts.COUNT_USAGE)

    async def close(self) -> None:
        await self.r.aclose()
        await self.raw.aclose()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    # ------------------------------------------------------------ files

    def writer(self, file_id: str, quota: int = 0) -> FileWriter:
        """Writes file `file_id` chunk by chunk; it exists for readers only once committed. Its bytes count in
        `usage` as they are written; with a `quota`, a chunk that would take `usage` past it is refused."""
        return FileWriter(self, file_id, quota)

    async def usage(self) -> int:
        """Bytes counted against the quota: every file, plus what unfinished writers wrote."""
        return int(await self.r.get(self.k.usage) or 0)

    async def count_usage(self) -> int:
        """Start `usage` from the files already stored, where Redis has none yet (files kept before it was)."""
        return int(await self._count_usage(keys=[self.k.usage, self.k.files, self.k.reserved],
                                           args=[f"{self.k.prefix}file:"]))

    async def put_file(self, file_id: str, filename: str, purpose: str, content: bytes) -> dict:
        """Store a small file held in memory (see `writer` for any other)."""
        writer = self.writer(file_id)
        await writer.start()
        await writer.write(content)
        return await writer.commit(filename, purpose)

    async def get_file(self, file_id: str) -> dict | None:
        """The file object; None when there is none or it has expired."""
        [meta] = await self.get_files([file_id]) or [None]
        return meta

    async def get_files(self, file_ids: list[str]) -> list[dict]:
        """The objects of those of `file_ids` that exist and have not expired."""
        async with self.r.pipeline(transaction=False) as pipe:
            for file_id in file_ids:
                pipe.hgetall(self.k.file(file_id))
            metas = await pipe.execute()
        t = now()
        return [m for m in metas if m and not (m.get("expires_at") and int(m["expires_at"]) <= t)]

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

    async def delete_file(self, file_id: str, sweep: bool = False) -> str:
        """'deleted', 'missing', 'expired' (gone already for clients), 'in_use:{batch_id}' (a batch still reads
        it), or with `sweep` (remove it only if it expired) 'live'. See scripts.DELETE_FILE."""
        k = self.k
        return await self._delete_file(
            keys=[k.file(file_id), k.content(file_id), k.users(file_id), k.files, k.usage, k.expiries],
            args=[file_id, now(), "1" if sweep else "0"])

    async def sweep_files(self) -> tuple[int, int]:
        """Remove files past their expiry and release the bytes of writers that stopped long ago, a bounded
        number per call: (files removed, abandoned uploads released)."""
        t, k = now(), self.k
        removed = released = 0
        for file_id in await self.r.zrange(k.expiries, "-inf", t, byscore=True, offset=0, num=SWEEP_BATCH):
            removed += await self.delete_file(file_id, sweep=True) == "expired"
        for file_id in await self.r.zrange(k.uploads, "-inf", t, byscore=True, offset=0, num=SWEEP_BATCH):
            released += await self._release_upload(keys=k.upload_keys(file_id), args=[file_id, t]) >= 0
        return removed, released

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

    async def create_batch(self, batch_id: str, input_file_id: str, fields: dict[str, str | int],
                           max_unfinished: int = 0) -> str:
        """Create a `validating` batch, mark its input file in use and queue its validation, atomically.

        Returns 'ok', 'missing' (no such file, or it expired), 'purpose:{purpose}' (not a batch input file) or
        'busy' (`max_unfinished` batches have not ended yet; 0: no limit)."""
        flat: list[str | int] = []
        for key, value in fields.items():
            flat += [key, value]
        return await self._create_batch(
            keys=[self.k.file(input_file_id), self.k.users(input_file_id), self.k.batch(batch_id),
                  self.k.batches, self.k.deadlines, self.k.control],
            args=[batch_id, fields["expires_at"], now(), max_unfinished, *flat])

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
    in one script (or discarded). Lifecycle: start -> write... -> commit | discard. Each chunk is counted in
    `usage` (and checked against the quota) before it is stored; discarding gives the bytes back, committing
    makes them the file's. Starting again drops what an earlier, interrupted attempt wrote, so a retried writer
    ends with the same file."""

    def __init__(self, store: Store, file_id: str, quota: int = 0) -> None:
        self.store, self.file_id, self.quota = store, file_id, quota
        self.key = store.k.upload(file_id)
        self.size = 0
        self._buffer = bytearray()
        self._pushed = False
        self._stored = 0  # bytes pushed, counted in `usage`

    async def start(self) -> None:
        await self._release()

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        self._buffer += data
        while len(self._buffer) >= FILE_CHUNK:
            await self._push(bytes(self._buffer[:FILE_CHUNK]))
            del self._buffer[:FILE_CHUNK]

    async def _push(self, chunk: bytes) -> None:
        """Raises QuotaExceeded (nothing of `chunk` stored) when it would take `usage` past the quota."""
        stored, used = await self.store._push_chunk(
            keys=self.store.k.upload_keys(self.file_id),
            args=[self.file_id, chunk, self.quota, now() + UNFINISHED_TTL_S, UNFINISHED_TTL_S])
        if not stored:
            raise QuotaExceeded(int(used) - self._stored, self.quota, self._stored + len(chunk))
        self._pushed = True
        self._stored += len(chunk)

    async def commit(self, filename: str, purpose: str, expires_after_s: int | None = None,
                     max_files: int = 0) -> dict:
        """The file and its object appear together; returns the object. `expires_after_s`: it expires that long
        after its creation; `max_files`: TooManyFiles when the deployment already holds that many (0: no
        limit; a batch's output is never refused)."""
        if self._buffer or not self._pushed:
            await self._push(bytes(self._buffer))  # an empty file is one empty chunk
            self._buffer.clear()
        k, created = self.store.k, now()
        meta: dict[str, str | int] = {"id": self.file_id, "bytes": self.size, "created_at": created,
                                      "filename": filename, "purpose": purpose, "status": "processed"}
        if expires_after_s is not None:
            meta["expires_at"] = created + expires_after_s
        flat: list[str | int] = [v for pair in meta.items() for v in pair]
        done = await self.store._commit_file(
            keys=[*k.upload_keys(self.file_id), k.content(self.file_id), k.file(self.file_id), k.files,
                  k.expiries],
            args=[self.file_id, meta.get("expires_at", ""), max_files, *flat])
        if done == -1:
            raise TooManyFiles(max_files)
        if not done:
            raise RuntimeError(f"file {self.file_id}: its unfinished content was released before the commit")
        return meta

    async def discard(self) -> None:
        self._buffer.clear()
        await self._release()

    async def _release(self) -> None:
        await self.store._release_upload(keys=self.store.k.upload_keys(self.file_id), args=[self.file_id, ""])
        self._stored = 0


def dump(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
