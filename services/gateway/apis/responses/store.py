"""Stored responses of /v1/responses: what `previous_response_id`, GET, DELETE, input_items and cancel read.

A stored response is one record: the response object as the API shows it, and its input items: every item of
the conversation before its output, earlier turns included. That is what `input_items` lists and what a chained
request continues from, so a chain never needs its ancestors (one read, whatever its length; deleting or
expiring an earlier response breaks nothing).

Lifecycle of a record: written once when the response ends (completed, incomplete, failed, cancelled), or, for a
background response, written `queued` -> `in_progress` -> one of those. `update` changes a record only from the
statuses it names, atomically, so a cancel and a finish never both win. Every write sets the record to expire
`ttl_s` later.

Two places keep them. `RedisResponses` (--redis-url: the deployment's Redis, the one the jobs service uses):
every gateway replica sees the same records and they outlive a gateway restart. Keys (prefix
`pdserve:responses:`): `resp:{id}` hash {status, response (JSON), input (JSON)}. Without Redis,
`MemoryResponses`: this process's memory, bounded, as SGLang and vLLM keep them; a restart forgets them. With
several processes on the gateway's port (--gateway-workers) and no Redis, the first process keeps them in its
memory and the others reach it over their Unix sockets (`SiblingResponses`, siblings.py), so every process
sees every record.
"""
from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from pdserve.services.gateway.errors import ApiError

if TYPE_CHECKING:
    from pdserve.services.gateway.siblings import Siblings

PREFIX = "pdserve:responses:"
DEFAULT_TTL_S = 7 * 24 * 3600
MEMORY_CAPACITY = 4096  # responses one gateway keeps in memory without Redis (the oldest go first)
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
IN_FLIGHT = ("queued", "in_progress")

# Change a record only while its status is one of ARGV[1] (comma-separated); the new status, response and expiry.
_UPDATE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
if not string.find(',' .. ARGV[1] .. ',', ',' .. status .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'response', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""


def new_item_id(prefix: str) -> str:
    """An id of the API's shape: `resp_`, `msg_`, `fc_`, `rs_` ... then 32 hex digits."""
    return prefix + secrets.token_hex(16)


def is_response_id(value: str) -> bool:
    """Only ids this gateway issues can name a record (and so become part of a Redis key)."""
    return RESPONSE_ID.fullmatch(value) is not None


@dataclass
class Stored:
    response: dict  # the response object, as GET shows it
    input: list[dict]  # the conversation's items before this response's output, each with its id
    trace: str = ""  # W3C traceparent of the request that made it: a continuation's trace links to it


class ResponseStore:
    """Where stored responses live; `shared` says whether other replicas and a restarted gateway see them."""

    shared = False
    where = ""  # for messages: where the records are kept

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s

    async def put(self, record: Stored) -> None:
        raise NotImplementedError

    async def get(self, response_id: str) -> Stored | None:
        raise NotImplementedError

    async def update(self, response: dict, when: tuple[str, ...]) -> bool:
        """Replace the response object of a record whose status is one of `when`; whether it did."""
        raise NotImplementedError

    async def delete(self, response_id: str) -> bool:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class MemoryResponses(ResponseStore):
    where = "in this gateway's memory (no --redis-url): a restart forgets them and other replicas do not see them"

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, capacity: int = MEMORY_CAPACITY) -> None:
        super().__init__(ttl_s)
        self.capacity = capacity
        self.records: OrderedDict[str, tuple[float, Stored]] = OrderedDict()

    async def put(self, record: Stored) -> None:
        self.records[record.response["id"]] = (time.monotonic() + self.ttl_s, _copy(record))
        self.records.move_to_end(record.response["id"])
        while len(self.records) > self.capacity:
            self.records.popitem(last=False)

    async def get(self, response_id: str) -> Stored | None:
        entry = self.records.get(response_id)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self.records[response_id]
            return None
        return _copy(entry[1])

    async def update(self, response: dict, when: tuple[str, ...]) -> bool:
        current = await self.get(response["id"])
        if current is None or current.response["status"] not in when:
            return False
        await self.put(Stored(response, current.input, current.trace))
        return True

    async def delete(self, response_id: str) -> bool:
        return self.records.pop(response_id, None) is not None


class RedisResponses(ResponseStore):
    shared = True
    where = "in Redis"

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, prefix: str = PREFIX) -> None:
        from pdserve.services.jobs.store import connect  # the jobs service's client: reconnects, retries

        super().__init__(ttl_s)
        self.r = connect(url)
        self.prefix = prefix
        self._update = self.r.register_script(_UPDATE)

    def key(self, response_id: str) -> str:
        return f"{self.prefix}resp:{response_id}"

    async def put(self, record: Stored) -> None:
        key = self.key(record.response["id"])
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"status": record.response["status"], "response": json.dumps(record.response),
                                    "input": json.dumps(record.input), "trace": record.trace})
            pipe.expire(key, int(self.ttl_s))
            await pipe.execute()

    async def get(self, response_id: str) -> Stored | None:
        fields = await self.r.hmget(self.key(response_id), "response", "input", "trace")
        if fields[0] is None:
            return None
        trace = fields[2].decode() if isinstance(fields[2], bytes) else fields[2] or ""
        return Stored(json.loads(fields[0]), json.loads(fields[1] or "[]"), trace)

    async def update(self, response: dict, when: tuple[str, ...]) -> bool:
        done = await self._update(keys=[self.key(response["id"])],
                                  args=[",".join(when), response["status"], json.dumps(response), int(self.ttl_s)])
        return bool(done)

    async def delete(self, response_id: str) -> bool:
        return bool(await self.r.delete(self.key(response_id)))

    async def close(self) -> None:
        await self.r.aclose()


class SiblingResponses(ResponseStore):
    """The records of the gateway's first process, which keeps them in memory (`serve_memory`), read and written
    from another process over its Unix socket."""

    where = "in the gateway's memory (no --redis-url): a restart forgets them and other replicas do not see them"
    OWNER = 1  # the process that keeps the records
    TIMEOUT_S = 10.0

    def __init__(self, siblings: Siblings, ttl_s: float = DEFAULT_TTL_S) -> None:
        super().__init__(ttl_s)
        self.siblings = siblings

    async def _ask(self, op: str, body: dict) -> dict:
        try:
            return await self.siblings.ask(self.OWNER, f"responses/{op}", body, self.TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise ApiError(503, f"The stored responses cannot be reached now ({exc or 'no answer'}); retry.",
                           type="server_error") from None

    async def put(self, record: Stored) -> None:
        await self._ask("put", {"response": record.response, "input": record.input, "trace": record.trace})

    async def get(self, response_id: str) -> Stored | None:
        found = (await self._ask("get", {"id": response_id}))["record"]
        return None if found is None else Stored(found["response"], found["input"], found.get("trace", ""))

    async def update(self, response: dict, when: tuple[str, ...]) -> bool:
        return (await self._ask("update", {"response": response, "when": list(when)}))["done"]

    async def delete(self, response_id: str) -> bool:
        return (await self._ask("delete", {"id": response_id}))["done"]


def serve_memory(store: MemoryResponses, siblings: Siblings) -> None:
    """Answer the other processes' `SiblingResponses` calls from `store`."""
    async def put(body: dict) -> dict:
        await store.put(Stored(body["response"], body["input"], body.get("trace", "")))
        return {}

    async def get(body: dict) -> dict:
        record = await store.get(body["id"])
        return {"record": None if record is None else {"response": record.response, "input": record.input,
                                                       "trace": record.trace}}

    async def update(body: dict) -> dict:
        return {"done": await store.update(body["response"], tuple(body["when"]))}

    async def delete(body: dict) -> dict:
        return {"done": await store.delete(body["id"])}

    for name, handler in (("put", put), ("get", get), ("update", update), ("delete", delete)):
        siblings.handle(f"responses/{name}", handler)


def _copy(record: Stored) -> Stored:
    """Records in memory are handed out as copies, as Redis would: a caller's edits never reach the store."""
    return Stored(json.loads(json.dumps(record.response)), json.loads(json.dumps(record.input)), record.trace)


def open_store(redis_url: str | None, ttl_s: float = DEFAULT_TTL_S, siblings: Siblings | None = None) -> ResponseStore:
    """Redis where given; else this process's memory, or with `siblings` (several processes on the port) the
    first process's memory."""
    if redis_url:
        return RedisResponses(redis_url, ttl_s)
    if siblings is None:
        return MemoryResponses(ttl_s)
    if siblings.index != SiblingResponses.OWNER:
        return SiblingResponses(siblings, ttl_s)
    store = MemoryResponses(ttl_s)
    store.where = SiblingResponses.where
    serve_memory(store, siblings)
    return store
