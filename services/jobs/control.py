"""Batch-level tasks a worker runs from the control stream: validate a new batch, finalize an ending one.

validate: read the input file once to check it: -> `failed` with `errors` and nothing queued; else read it
again and queue its items in chunks, the first of which enters `in_progress` (see `_queue`). Every step is
guarded by WATCH, so a cancel or expiry that lands first wins.
finalize: freeze the results, write them as output/error Files in input order, enter the terminal status.
Neither task holds a whole file, nor anything per request: both stream it from Redis (custom_ids are checked
for uniqueness in Redis, see unique_ids.py). Each step is idempotent, so a task re-run after a crash at any
point ends in the same state. Output files count against the storage quota but are never refused by it.
"""
from __future__ import annotations

import json
import logging

from redis.exceptions import WatchError

from pdserve.services.jobs.batches import MAX_REQUESTS, InputChecker, Item, LineErrors, NotText, numbered_lines
from pdserve.services.jobs.files import OUTPUT_PURPOSE
from pdserve.services.jobs.store import FILE_ID, Store, dump, new_id, now
from pdserve.services.jobs.unique_ids import UniqueIds
from pdserve.services.jobs.workqueue import Queue

log = logging.getLogger("pdserve.jobs.control")
QUEUE_CHUNK = 500  # items queued per MULTI/EXEC
RESULT_CHUNK = 1000  # results looked up per round trip while finalizing


async def validate(store: Store, batch_id: str) -> None:
    """Check the input file (one streaming pass), then queue its items (a second pass, QUEUE_CHUNK at a time)."""
    record = await store.r.hgetall(store.k.batch(batch_id))
    if record.get("status") not in ("validating", "in_progress") or record.get("finalize_to"):
        return
    if record["status"] == "in_progress" and int(record.get("queued", record.get("total", 0))) >= int(record["total"]):
        return  # a re-run of a task that completed (or a batch queued whole, before `queued` was kept)
    checker, first_item = await _check(store, batch_id, record)
    errors = checker.finish()
    if errors.errors:
        await _fail(store, batch_id, record["input_file_id"], errors)
        return
    model = first_item.body.get("model") if first_item else None
    start = {"status": "in_progress", "in_progress_at": now(), "total": checker.count,
             "model": model if isinstance(model, str) else ""}
    if await _queue(store, batch_id, record, start):
        log.info("batch %s in progress: %d requests", batch_id, checker.count)


async def _check(store: Store, batch_id: str, record: dict) -> tuple[InputChecker, Item | None]:
    """One streaming pass over the input file: each line parsed, and custom_ids checked for uniqueness in Redis
    a chunk at a time (only the first MAX_REQUESTS: a file with more fails anyway). Returns the checker (its
    errors and count) and the first request."""
    checker, ids = InputChecker(record["endpoint"]), UniqueIds(store, batch_id)
    first_item: Item | None = None

    async def report() -> None:
        for dup in await ids.flush():
            checker.duplicate(dup.line, dup.custom_id, dup.first_line)

    try:
        try:
            async for number, line in numbered_lines(store.iter_content(record["input_file_id"])):
                item = checker.feed(number, line)
                first_item = first_item or item
                if item is not None and checker.count <= MAX_REQUESTS and ids.add(number, item.custom_id):
                    await report()
        except NotText as exc:
            checker.not_text(exc)
        await report()
    finally:
        await ids.close()
    return checker, first_item


async def _fail(store: Store, batch_id: str, input_file_id: str, errors: LineErrors) -> None:
    key = store.k.batch(batch_id)
    if await _guarded(store, key, lambda status, to, queued: status == "validating" and not to, lambda pipe: (
            pipe.hset(key, mapping={"status": "failed", "failed_at": now(), "errors": dump(errors.as_object())}),
            pipe.srem(store.k.users(input_file_id), batch_id),
            pipe.zrem(store.k.deadlines, batch_id))):
        log.info("batch %s failed validation: %s", batch_id, errors.errors[0]["message"])


async def _queue(store: Store, batch_id: str, record: dict, start: dict) -> bool:
    """Queue the items QUEUE_CHUNK at a time. Each chunk is one MULTI/EXEC that also moves `queued` on (the first
    one also enters in_progress), guarded by WATCH: a re-run after a crash resumes after the last chunk, and a
    cancel or expiry that lands meanwhile stops it. Whether every item was queued."""
    key = store.k.batch(batch_id)
    done = int(record.get("queued", 0)) if record["status"] == "in_progress" else 0
    pending: list[Item] = []
    index = 0

    async def flush() -> bool:
        nonlocal done
        first, end = done == 0, done + len(pending)

        def may(status: str | None, to: str | None, queued: str | None) -> bool:
            if to:
                return False
            return status == "validating" if first else status == "in_progress" and int(queued or 0) == done

        def write(pipe) -> None:
            pipe.hset(key, mapping={**(start if first else {}), "queued": end})
            for item in pending:
                pipe.xadd(store.k.items, {"b": batch_id, "i": item.index, "c": item.custom_id,
                                          "u": record["endpoint"], "body": dump(item.body),
                                          "t": record.get("trace", "")})

        if not await _guarded(store, key, may, write):
            return False
        done = end
        pending.clear()
        return True

    checker = InputChecker(record["endpoint"])
    async for number, line in numbered_lines(store.iter_content(record["input_file_id"])):
        item = checker.feed(number, line)
        if item is None:
            continue
        index += 1
        if index <= done:
            continue  # queued by an earlier run of this task
        pending.append(item)
        if len(pending) >= QUEUE_CHUNK and not await flush():
            return False
    return await flush() if pending else True


async def _guarded(store: Store, key: str, may, write) -> bool:
    """Run `write(pipe)` in a MULTI/EXEC if `may(status, finalize_to, queued)` holds for the batch, retried
    while the batch changes under it (WATCH); whether it ran."""
    while True:
        try:
            async with store.r.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                if not may(*await pipe.hmget(key, "status", "finalize_to", "queued")):
                    return False
                pipe.multi()
                write(pipe)
                await pipe.execute()
                return True
        except WatchError:
            continue


async def finalize(store: Store, queue: Queue, batch_id: str) -> None:
    """Write the recorded results as the output and error files, in input order, without holding either: the
    input file is read again and the results looked up RESULT_CHUNK custom_ids at a time."""
    record = await store.r.hgetall(store.k.batch(batch_id))
    frozen = await queue.freeze(batch_id, new_id(FILE_ID), new_id(FILE_ID))
    if not record.get("input_file_id") or frozen is None:
        return
    final_status, output_id, error_id = frozen
    expires_after_s = int(record["output_expires_after"]) if record.get("output_expires_after") else None
    out, err = store.writer(output_id), store.writer(error_id)
    for writer in (out, err):
        await writer.start()
    counts = [0, 0]
    ids: list[str] = []

    async def flush() -> None:
        for n, (writer, lines) in enumerate(zip((out, err), await queue.results_of(batch_id, ids))):
            for line in lines:
                await writer.write(line.encode() + b"\n")
            counts[n] += len(lines)
        ids.clear()

    checker = InputChecker(record["endpoint"])
    async for number, line in numbered_lines(store.iter_content(record["input_file_id"])):
        item = checker.feed(number, line)
        if item is not None:
            ids.append(item.custom_id)
            if len(ids) >= RESULT_CHUNK:
                await flush()
    await flush()
    written: list[str | None] = []
    for writer, count, kind in ((out, counts[0], "output"), (err, counts[1], "error")):
        if count:
            await writer.commit(f"{batch_id}_{kind}.jsonl", OUTPUT_PURPOSE, expires_after_s)
        else:
            await writer.discard()
        written.append(writer.file_id if count else None)
    if await queue.finish(batch_id, record["input_file_id"], *written):
        log.info("batch %s %s: %d succeeded, %d failed", batch_id, final_status, *counts)


async def run_task(store: Store, queue: Queue, fields: dict[str, str]) -> None:
    op, batch_id = fields.get("op"), fields.get("batch", "")
    if op == "validate":
        await validate(store, batch_id)
    elif op == "finalize":
        await finalize(store, queue, batch_id)
    else:
        log.warning("ignoring unknown control task %s", json.dumps(fields))
