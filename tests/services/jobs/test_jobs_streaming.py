"""Files and batches without holding a whole file anywhere: content in chunks in Redis, streamed in and out, and
a batch queued and finalized in pieces (output still in input order, each custom_id once), resuming a queueing
cut short by a crash. Real redis-server, jobs service and batch worker (the shared system of conftest.py)."""
from __future__ import annotations

import asyncio
import json
import os

import openai
import pytest
import redis

from jobs_harness import MAX_FILE_SIZE, PREFIX, chat_line, create_batch, read_lines, upload, wait_batch
from pdserve.services.jobs import control
from pdserve.services.jobs.batches import LineSplitter, NotText
from pdserve.services.jobs.store import BATCH_ID, FILE_CHUNK, Store, new_id


def leftovers(r) -> list[str]:
    return list(r.scan_iter(PREFIX + "file:*:upload"))


def test_a_file_is_stored_in_chunks_and_streams_back_whole(jobs_system):
    c, r = jobs_system.client(), jobs_system.redis.client()
    content = os.urandom(MAX_FILE_SIZE - 1000)  # nearly two chunks
    created = upload(c, content, name="blob.bin", purpose="user_data")
    key = f"{PREFIX}file:{created.id}:content"
    chunks = redis.Redis(port=jobs_system.redis.port).lrange(key, 0, -1)  # raw bytes
    assert [len(x) for x in chunks] == [FILE_CHUNK, len(content) - FILE_CHUNK]
    assert c.files.content(created.id).read() == content
    assert leftovers(r) == []
    c.files.delete(created.id)
    assert not r.exists(key)


def test_a_refused_upload_leaves_nothing_behind(jobs_system):
    c, r = jobs_system.client(), jobs_system.redis.client()
    before = r.zcard(PREFIX + "files")
    with pytest.raises(openai.APIStatusError) as info:
        upload(c, b"x" * (MAX_FILE_SIZE + 1), purpose="user_data")  # its first chunk was written already
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        upload(c, b"y" * (FILE_CHUNK + 10), purpose="not-a-purpose")  # known bad only after the whole file
    assert r.zcard(PREFIX + "files") == before and leftovers(r) == []


def test_a_batch_larger_than_its_chunks_keeps_input_order_and_each_id_once(jobs_system):
    c, r = jobs_system.client(), jobs_system.redis.client()
    n = control.QUEUE_CHUNK * 2 + 37  # more than one chunk to queue, and more than RESULT_CHUNK to finalize
    assert n > control.RESULT_CHUNK
    lines = [chat_line(f"req-{i}", f"q{i}", **({"x_status": 400} if i % 97 == 5 else {})) for i in range(n)]
    batch = create_batch(c, lines)
    done, _ = wait_batch(c, batch.id, timeout=120)
    assert done.status == "completed"
    out, err = read_lines(c, done.output_file_id), read_lines(c, done.error_file_id)
    expected_errors = [f"req-{i}" for i in range(n) if i % 97 == 5]
    assert [x["custom_id"] for x in err] == expected_errors
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(n) if i % 97 != 5]
    assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(err))
    assert leftovers(r) == []


def test_line_splitting_across_chunks():
    text = '{"a": "é"}\r\n\n{"b": "日本"}\nlast'.encode()
    for size in (1, 2, 3, 7, len(text)):
        splitter = LineSplitter()
        lines = []
        for i in range(0, len(text), size):  # chunk ends fall inside "é" and "日本" too
            lines += splitter.feed(text[i:i + size])
        lines += splitter.feed(b"", final=True)
        assert lines == [(1, '{"a": "é"}'), (2, ""), (3, '{"b": "日本"}'), (4, "last")], size
    splitter = LineSplitter()
    splitter.feed(b"ok\n")
    with pytest.raises(NotText, match="at byte 5"):
        splitter.feed(b"ab\xff")


def test_queueing_cut_short_by_a_crash_resumes_where_it_stopped(jobs_system, monkeypatch):
    """validate() run on a batch of our own, crashing after its first chunk, then run again."""
    monkeypatch.setattr(control, "QUEUE_CHUNK", 10)
    lines = [chat_line(f"c-{i}", "hi") for i in range(25)]

    async def scenario() -> dict:
        store = Store(jobs_system.redis.url(db=3), prefix="test-resume:")
        try:
            await store.r.flushdb()
            file_id, batch_id = new_id("file-"), new_id(BATCH_ID)
            await store.put_file(file_id, "in.jsonl", "batch",
                                 "".join(json.dumps(x) + "\n" for x in lines).encode())
            assert await store.create_batch(batch_id, file_id, {
                "id": batch_id, "status": "validating", "endpoint": "/v1/chat/completions",
                "input_file_id": file_id, "completion_window": "24h", "created_at": 0, "expires_at": 2 ** 40,
                "total": 0, "metadata": ""}) == "ok"
            real, calls = control._guarded, []

            async def crash_after_one(*args):
                if calls:
                    raise ConnectionError("the worker died")
                calls.append(1)
                return await real(*args)

            monkeypatch.setattr(control, "_guarded", crash_after_one)
            with pytest.raises(ConnectionError):
                await control.validate(store, batch_id)
            record = await store.r.hgetall(store.k.batch(batch_id))
            assert (record["status"], record["queued"], record["total"]) == ("in_progress", "10", "25")
            monkeypatch.setattr(control, "_guarded", real)
            await control.validate(store, batch_id)  # the task, delivered again
            await control.validate(store, batch_id)  # and once more: nothing left to do
            entries = await store.r.xrange(store.k.items)
            return {"record": await store.r.hgetall(store.k.batch(batch_id)),
                    "ids": [fields["c"] for _, fields in entries], "index": [int(f["i"]) for _, f in entries]}
        finally:
            await store.r.flushdb()
            await store.close()

    result = asyncio.run(scenario())
    assert result["ids"] == [f"c-{i}" for i in range(25)] and result["index"] == list(range(25))
    assert result["record"]["queued"] == "25"
