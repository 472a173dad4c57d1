"""Batch-level tasks a worker runs from the control stream: validate a new batch, finalize an ending one.

validate: `validating` -> `in_progress` with every item queued, or -> `failed` with `errors` and nothing
queued, in one MULTI/EXEC guarded by WATCH (a cancel or expiry that lands first wins).
finalize: freeze the results, write them as output/error Files, enter the terminal status. Each step is
idempotent, so a task re-run after a crash at any point ends in the same state.
"""
from __future__ import annotations

import json
import logging

from redis.exceptions import WatchError

from pdserve.services.jobs.batches import parse_input
from pdserve.services.jobs.files import OUTPUT_PURPOSE
from pdserve.services.jobs.store import FILE_ID, Store, dump, new_id, now
from pdserve.services.jobs.workqueue import Queue

log = logging.getLogger("pdserve.jobs.control")


async def validate(store: Store, batch_id: str) -> None:
    record = await store.r.hgetall(store.k.batch(batch_id))
    if record.get("status") != "validating" or record.get("finalize_to"):
        return
    content = await store.file_content(record["input_file_id"])
    items, errors = parse_input(content or b"", record["endpoint"])
    key = store.k.batch(batch_id)
    while True:
        try:
            async with store.r.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                status, finalize_to = await pipe.hmget(key, "status", "finalize_to")
                if status != "validating" or finalize_to:
                    return
                pipe.multi()
                if errors.errors:
                    pipe.hset(key, mapping={"status": "failed", "failed_at": now(), "errors": dump(errors.as_object())})
                    pipe.srem(store.k.users(record["input_file_id"]), batch_id)
                    pipe.zrem(store.k.deadlines, batch_id)
                else:
                    model = items[0].body.get("model")
                    pipe.hset(key, mapping={"status": "in_progress", "in_progress_at": now(), "total": len(items),
                                            "model": model if isinstance(model, str) else ""})
                    for item in items:
                        pipe.xadd(store.k.items, {"b": batch_id, "i": item.index, "c": item.custom_id,
                                                  "u": record["endpoint"], "body": dump(item.body)})
                await pipe.execute()
                break
        except WatchError:
            continue
    if errors.errors:
        log.info("batch %s failed validation: %s", batch_id, errors.errors[0]["message"])
    else:
        log.info("batch %s in progress: %d requests", batch_id, len(items))


async def finalize(store: Store, queue: Queue, batch_id: str) -> None:
    input_file_id = await store.r.hget(store.k.batch(batch_id), "input_file_id")
    frozen = await queue.freeze(batch_id, new_id(FILE_ID), new_id(FILE_ID))
    if input_file_id is None or frozen is None:
        return
    final_status, output_id, error_id = frozen
    out, err = await queue.results(batch_id)
    written: list[str | None] = []
    for lines, file_id, kind in ((out, output_id, "output"), (err, error_id, "error")):
        if lines:
            await store.put_file(file_id, f"{batch_id}_{kind}.jsonl", OUTPUT_PURPOSE,
                                 ("\n".join(lines) + "\n").encode())
        written.append(file_id if lines else None)
    if await queue.finish(batch_id, input_file_id, *written):
        log.info("batch %s %s: %d succeeded, %d failed", batch_id, final_status, len(out), len(err))


async def run_task(store: Store, queue: Queue, fields: dict[str, str]) -> None:
    op, batch_id = fields.get("op"), fields.get("batch", "")
    if op == "validate":
        await validate(store, batch_id)
    elif op == "finalize":
        await finalize(store, queue, batch_id)
    else:
        log.warning("ignoring unknown control task %s", json.dumps(fields))
