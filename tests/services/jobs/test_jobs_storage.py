"""Storage bounds of the jobs service (real redis-server, real `pdserve jobs`, official openai client): the
deployment's file quota (507, nothing stored, freed by delete and expiry, batch output counted), OpenAI's
`expires_after` / `output_expires_after`, and batch validation whose memory does not grow with the file
(custom_id uniqueness checked in Redis; duplicates still reported with both lines)."""
from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from jobs_harness import PREFIX, Upstream, chat_line, client, jsonl, start_jobs, upload, wait_batch
from pdserve.services.jobs.batches import MAX_ERRORS, LineErrors
from pdserve.services.jobs.files import size_text
from pdserve.services.jobs.store import Store

QUOTA = 12_000_000
MAX_FILE = 8_000_000
DB = 1  # the quota system's Redis database (the shared system uses 0)


@pytest.fixture(scope="module")
def quota_system(jobs_system):
    """`pdserve jobs` with a small quota and expiry allowed from 1 s, on its own Redis database and upstream (the
shared one counts the shared system's concurrency)."""
    redis = jobs_system.redis.client(DB)
    redis.flushdb()
    upstream = Upstream(delay=0.02).start()
    proc = None
    try:
        proc, url = start_jobs(jobs_system.redis.url(DB), upstream.url, "--batch-workers", "1",
                               "--max-file-size", str(MAX_FILE), "--files-quota-bytes", str(QUOTA),
                               "--min-file-expiry-seconds", "1", "--lease-seconds", "3")
        yield client(url), redis
    finally:
        if proc is not None:
            proc.stop()
        upstream.stop()


def usage(redis) -> int:
    return int(redis.get(PREFIX + "usage") or 0)


def stored_bytes(redis) -> int:
    """What the files in Redis hold, summed from their objects."""
    return sum(int(redis.hget(f"{PREFIX}file:{i}", "bytes") or 0) for i in redis.zrange(PREFIX + "files", 0, -1))


def nothing_unfinished(redis) -> bool:
    return not redis.keys(PREFIX + "file:*:upload") and not redis.hlen(PREFIX + "reserved") \
        and not redis.zcard(PREFIX + "uploads")


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def refused_for_quota(c, redis, size: int) -> None:
    """An upload of `size` bytes gets 507 in OpenAI's error shape, and nothing of it stays."""
    files_before, usage_before = redis.zcard(PREFIX + "files"), usage(redis)
    with pytest.raises(openai.APIStatusError) as info:
        upload(c, b"c" * size, name="c.bin", purpose="user_data")
    assert info.value.status_code == 507
    assert info.value.response.headers["x-should-retry"] == "false"  # the client must not resend it
    error = info.value.body
    assert (error["param"], error["code"], error["type"]) == ("file", "files_quota_exceeded", "insufficient_storage")
    assert f"quota of {QUOTA} bytes" in error["message"] and "--files-quota-bytes" in error["message"]
    assert f"{size_text(usage_before)} of its quota" in error["message"] and "in use by other files" in error["message"]
    assert redis.zcard(PREFIX + "files") == files_before and usage(redis) == usage_before
    assert nothing_unfinished(redis)


def test_upload_past_the_quota_is_refused_with_507_and_nothing_stored(quota_system):
    c, redis = quota_system
    a = upload(c, b"a" * 7_000_000, name="a.bin", purpose="user_data")
    assert usage(redis) == stored_bytes(redis) == 7_000_000
    refused_for_quota(c, redis, 6_500_000)  # clearly too much: refused from its Content-Length
    refused_for_quota(c, redis, 6_000_000)  # refused part-way, its first 4 MiB stored: they are given back
    b = upload(c, b"b" * 5_000_000, name="b.bin", purpose="user_data")  # fills the quota exactly
    assert usage(redis) == stored_bytes(redis) == QUOTA
    refused_for_quota(c, redis, 1)  # refused as it is read: its chunk would pass the quota
    # Deleting frees the storage at once: the refused upload now fits.
    c.files.delete(a.id)
    assert usage(redis) == stored_bytes(redis) == 5_000_000
    again = upload(c, b"c" * 6_000_000, name="c.bin", purpose="user_data")
    assert c.files.retrieve(again.id).bytes == 6_000_000
    for f in (b, again):
        c.files.delete(f.id)
    assert usage(redis) == stored_bytes(redis) == 0 and nothing_unfinished(redis)


def test_expired_file_is_404_and_its_storage_freed(quota_system):
    c, redis = quota_system
    keep = upload(c, b"keep\n", name="keep.txt", purpose="user_data")
    before = usage(redis)
    f = c.files.create(file=("short.txt", b"x" * 100_000), purpose="user_data",
                       expires_after={"anchor": "created_at", "seconds": 2})
    assert f.expires_at == f.created_at + 2
    wait_for(lambda: time.time() >= f.expires_at + 0.05)
    for call in (c.files.retrieve, c.files.content, c.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert f.id not in [x.id for x in c.files.list()]
    wait_for(lambda: usage(redis) == before)  # the sweep removed it
    assert not redis.keys(f"{PREFIX}file:{f.id}*") and redis.zscore(PREFIX + "expiries", f.id) is None
    assert c.files.retrieve(keep.id).expires_at is None  # no expiry asked: it stays
    c.files.delete(keep.id)


def test_expired_batch_input_is_404_and_cannot_start_a_batch(quota_system):
    c, redis = quota_system
    f = c.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch",
                       expires_after={"anchor": "created_at", "seconds": 1})
    wait_for(lambda: time.time() >= f.expires_at + 0.05)
    with pytest.raises(openai.NotFoundError) as info:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert info.value.body["param"] == "input_file_id"
    wait_for(lambda: not redis.exists(f"{PREFIX}file:{f.id}"))
    assert usage(redis) == stored_bytes(redis)


def test_batch_output_counts_against_the_quota(quota_system):
    c, redis = quota_system
    before = usage(redis)
    inp = upload(c, jsonl([chat_line(f"r{i}", f"hello {i}") for i in range(20)]))
    batch = c.batches.create(input_file_id=inp.id, endpoint="/v1/chat/completions", completion_window="24h",
                             output_expires_after={"anchor": "created_at", "seconds": 7200})
    done, _ = wait_batch(c, batch.id, timeout=90)
    assert done.status == "completed" and done.request_counts.completed == 20
    out = c.files.retrieve(done.output_file_id)
    assert out.expires_at == out.created_at + 7200
    assert usage(redis) == stored_bytes(redis) == before + inp.bytes + out.bytes
    for file_id in (inp.id, out.id):
        c.files.delete(file_id)
    assert usage(redis) == stored_bytes(redis) == before


def test_expires_after_outside_openai_bounds_is_400_and_stores_nothing(jobs_system):
    c, redis = jobs_system.client(), jobs_system.redis.client()
    files_before, usage_before = redis.zcard(PREFIX + "files"), usage(redis)
    for expires_after, param, words in [
        ({"anchor": "created_at", "seconds": 3599}, "expires_after[seconds]", ("3600", "2592000", "3599")),
        ({"anchor": "created_at", "seconds": 2592001}, "expires_after[seconds]", ("2592000",)),
        ({"anchor": "created_at", "seconds": "soon"}, "expires_after[seconds]", ("integer",)),
        ({"anchor": "created_at"}, "expires_after[seconds]", ("required",)),
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after[anchor]", ("created_at",)),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            c.files.create(file=("x.txt", b"x" * 1000), purpose="user_data", expires_after=expires_after)
        assert info.value.body["param"] == param, info.value.body
        assert all(w in info.value.body["message"] for w in words), info.value.body["message"]
    assert redis.zcard(PREFIX + "files") == files_before and usage(redis) == usage_before
    assert nothing_unfinished(redis)
    ok = c.files.create(file=("x.txt", b"x"), purpose="user_data",
                        expires_after={"anchor": "created_at", "seconds": 3600})
    assert ok.expires_at == ok.created_at + 3600
    c.files.delete(ok.id)
    f = upload(c, jsonl([chat_line("a", "hi")]))
    with pytest.raises(openai.BadRequestError) as info:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         output_expires_after={"anchor": "created_at", "seconds": 60})
    assert info.value.body["param"] == "output_expires_after[seconds]"
    c.files.delete(f.id)


def short_line(custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}


def test_duplicate_custom_ids_are_reported_across_a_large_file(jobs_system):
    """Duplicates within one checked chunk, across chunks far apart, and of long ids (kept as digests)."""
    c, redis = jobs_system.client(), jobs_system.redis.client()
    long_id = "L" * 500
    ids = [f"req-{i}" for i in range(5000)]
    ids[2] = long_id
    ids[10] = ids[9]  # the next line
    ids[2999] = long_id  # line 3000 repeats line 3
    ids[4499] = ids[1]  # line 4500 repeats line 2
    f = upload(c, jsonl([short_line(i) for i in ids]))
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done, _ = wait_batch(c, batch.id, timeout=60)
    assert done.status == "failed"
    assert [(e.line, e.code) for e in done.errors.data] == [
        (11, "duplicate_custom_id"), (3000, "duplicate_custom_id"), (4500, "duplicate_custom_id")]
    messages = [e.message for e in done.errors.data]
    assert "'req-9'" in messages[0] and "line 10" in messages[0]
    assert "line 3;" in messages[1] and len(messages[1]) < 300  # the long id is shown cut short
    assert "'req-1'" in messages[2] and "line 2;" in messages[2]
    assert not redis.keys(f"{PREFIX}batch:{batch.id}:ids:*")
    c.files.delete(f.id)


def test_a_file_at_the_request_limit_validates(quota_system):
    """50,000 requests (~4.5 MB) validate and are queued; the uniqueness check leaves nothing in Redis."""
    c, redis = quota_system
    lines = [json.dumps({"custom_id": f"request-{i:06d}", "url": "/v1/chat/completions", "body": {"model": "m"}},
                        separators=(",", ":")) for i in range(50_000)]
    f = upload(c, "\n".join(lines).encode())
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    running, _ = wait_batch(c, batch.id, statuses={"in_progress", "failed"}, timeout=60)
    assert running.status == "in_progress" and running.request_counts.total == 50_000
    c.batches.cancel(batch.id)
    wait_batch(c, batch.id, timeout=60)
    assert not redis.keys(f"{PREFIX}batch:{batch.id}:ids:*")


def test_line_errors_keep_the_earliest_lines_whatever_the_order_found():
    errors = LineErrors()
    for line in [*range(MAX_ERRORS + 50, 50, -1), 7, None, 3]:
        errors.add(line, "x", f"line {line}")
    kept = [e["line"] for e in errors.errors]
    assert kept == [3, 7, *range(51, 51 + MAX_ERRORS - 2)]
    assert errors.as_object()["data"][-1]["code"] == "too_many_errors"


def test_usage_is_counted_from_files_stored_before_the_quota(jobs_system):
    """A Redis holding files but no count (kept by an earlier version) starts counting from them."""
    redis = jobs_system.redis.client(2)
    redis.flushdb()
    for file_id, size in (("file-old1", 300), ("file-old2", 1200)):
        redis.hset(f"{PREFIX}file:{file_id}", mapping={"id": file_id, "bytes": size, "purpose": "batch"})
        redis.zadd(PREFIX + "files", {file_id: 0})

    async def count() -> tuple[int, int]:
        store = Store(jobs_system.redis.url(2))
        try:
            first = await store.count_usage()
            await store.r.incrby(store.k.usage, 10)  # counted from then on: a second count changes nothing
            return first, await store.count_usage()
        finally:
            await store.close()

    assert asyncio.run(count()) == (1500, 1510)
    redis.flushdb()
