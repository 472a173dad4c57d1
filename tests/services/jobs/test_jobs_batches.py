"""OpenAI Batches on the real jobs service: a real redis-server, one supervised batch worker, and the test
upstream (tests/services/jobs/upstream.py) in the gateway's place; driven by the official openai client."""
from __future__ import annotations

import json
import time

import openai
import pytest

import requests

from jobs_harness import (API_KEY, CONCURRENCY, PREFIX, RETRIES, batch_keys, chat_line, create_batch, jsonl,
                          read_lines, upload, wait_batch)


def reversed_text(line: dict) -> str:
    return line["body"]["messages"][-1]["content"][::-1]


def test_chat_batch_runs_every_request_once(jobs_system):
    c = jobs_system.client()
    lines = [chat_line(f"req-{i}", f"question number {i}") for i in range(30)]
    lines[7]["body"]["max_tokens"] = -1  # the upstream refuses it with a 400: an error line, not a lost one
    batch = create_batch(c, lines, metadata={"run": "happy"})
    assert batch.status == "validating" and batch.object == "batch"
    assert batch.endpoint == "/v1/chat/completions" and batch.completion_window == "24h"
    assert batch.metadata == {"run": "happy"}
    assert batch.expires_at == batch.created_at + 24 * 3600

    done, seen = wait_batch(c, batch.id)
    assert done.status == "completed", done
    assert seen[-1] == "completed" and set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert done.request_counts.model_dump() == {"total": 30, "completed": 29, "failed": 1}
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.model == "test-model" and done.errors is None

    out = read_lines(c, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(30) if i != 7)
    by_id = {line["custom_id"]: line for line in lines}
    for o in out:
        assert o["error"] is None and o["id"].startswith("batch_req_")
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"]
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == reversed_text(by_id[o["custom_id"]])
        assert body["x_max_tokens"] == 8
    assert len({o["id"] for o in out}) == len(out)
    [err] = read_lines(c, done.error_file_id)
    assert err["custom_id"] == "req-7" and err["response"]["status_code"] == 400
    assert "max_tokens" in err["response"]["body"]["error"]["message"]

    out_file = c.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output" and out_file.bytes > 0
    assert jobs_system.upstream.stats()["max_in_flight"] <= CONCURRENCY
    # Nothing of the batch is left behind but its record and files; the input file is free again.
    assert batch_keys(jobs_system.redis.client(), batch.id) == {
        "items": 0, "out": 0, "err": 0, "file_users": 0, "deadline": None}
    assert c.files.delete(batch.input_file_id).deleted


def test_completions_endpoint(jobs_system):
    c = jobs_system.client()
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": f"prompt {i}", "max_tokens": 8}} for i in range(5)]
    done, _ = wait_batch(c, create_batch(c, lines, endpoint="/v1/completions").id)
    assert done.status == "completed" and done.request_counts.completed == 5
    texts = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in read_lines(c, done.output_file_id)}
    assert texts == {f"c{i}": f"prompt {i}"[::-1] for i in range(5)}
    assert done.error_file_id is None


def test_server_errors_are_retried_then_recorded(jobs_system):
    c = jobs_system.client()
    prompt = f"always fails {time.time()}"
    done, _ = wait_batch(c, create_batch(c, [chat_line("ok", "fine"), chat_line("bad", prompt, x_status=503)]).id)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    [err] = read_lines(c, done.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 503
    assert jobs_system.upstream.stats()["by_prompt"][prompt] == RETRIES + 1


# A batch input file as client code often writes it: each line's "url" without the "/v1" of the endpoint.
SHORT_URL_LINES = [
    {"custom_id": "request-1", "method": "POST", "url": "/chat/completions",
     "body": {"model": "qwen/qwen2.5-0.5b-instruct",
              "messages": [{"role": "user", "content": "Tell me a joke about programming"}], "max_tokens": 50}},
    {"custom_id": "request-2", "method": "POST", "url": "/chat/completions",
     "body": {"model": "qwen/qwen2.5-0.5b-instruct", "messages": [{"role": "user", "content": "What is Python?"}],
              "max_tokens": 50}},
]


def test_urls_with_or_without_v1_name_the_same_endpoint(jobs_system):
    c = jobs_system.client()
    f = upload(c, jsonl(SHORT_URL_LINES), name="batch_requests.jsonl")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done, _ = wait_batch(c, batch.id)
    assert done.status == "completed", done.errors
    assert done.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
    answers = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"]
               for o in read_lines(c, done.output_file_id)}
    assert answers == {line["custom_id"]: reversed_text(line) for line in SHORT_URL_LINES}
    # The batch's endpoint may leave out "/v1" as well; the batch reports the full path.
    short = c.batches.create(input_file_id=f.id, endpoint="/chat/completions", completion_window="24h")
    assert short.endpoint == "/v1/chat/completions"
    assert wait_batch(c, short.id)[0].request_counts.completed == 2
    completions = [{"custom_id": f"c{i}", "method": "POST", "url": url, "body": {"prompt": f"text {i}"}}
                   for i, url in enumerate(["/completions", "/v1/completions"])]
    done, _ = wait_batch(c, create_batch(c, completions, endpoint="/completions").id)
    assert done.status == "completed" and done.endpoint == "/v1/completions"
    assert sorted(o["response"]["body"]["choices"][0]["text"] for o in read_lines(c, done.output_file_id)) == [
        "0 txet", "1 txet"]
    # A line naming another endpoint, however spelled, still fails the batch at that line.
    mixed = create_batch(c, [SHORT_URL_LINES[0], {**SHORT_URL_LINES[1], "url": "/completions"}])
    failed, _ = wait_batch(c, mixed.id)
    assert failed.status == "failed"
    assert [(e.line, e.code, e.param) for e in failed.errors.data] == [(2, "mismatched_url", "url")]
    assert "'/completions'" in failed.errors.data[0].message
    assert "'/v1/chat/completions'" in failed.errors.data[0].message


BAD_FILES = {
    "malformed_json": ([json.dumps(chat_line("a", "x")), '{"custom_id": "b", "url": ', json.dumps(chat_line("c", "y"))],
                       2, "invalid_json"),
    "url_mismatch": ([json.dumps(chat_line("a", "x")), json.dumps({**chat_line("b", "y"), "url": "/v1/completions"})],
                     2, "mismatched_url"),
    "missing_custom_id": ([json.dumps({k: v for k, v in chat_line("a", "x").items() if k != "custom_id"})],
                          1, "missing_custom_id"),
    "duplicate_custom_id": ([json.dumps(chat_line("a", "x")), json.dumps(chat_line("b", "y")),
                             json.dumps(chat_line("a", "z"))], 3, "duplicate_custom_id"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_input_file_fails_the_batch_naming_the_line(jobs_system, case):
    c = jobs_system.client()
    rows, line, code = BAD_FILES[case]
    f = upload(c, ("\n".join(rows) + "\n").encode())
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done, _ = wait_batch(c, batch.id)
    assert done.status == "failed" and done.failed_at >= done.created_at
    assert [(e.line, e.code) for e in done.errors.data] == [(line, code)]
    assert f"{line}" in done.errors.data[0].message
    assert done.output_file_id is None and done.request_counts.total == 0
    assert batch_keys(jobs_system.redis.client(), batch.id) == {
        "items": 0, "out": 0, "err": 0, "file_users": 0, "deadline": None}
    assert c.files.delete(f.id).deleted  # not held by the failed batch


def test_create_errors_leave_nothing_behind(jobs_system):
    c = jobs_system.client()
    r = jobs_system.redis.client()
    f = upload(c, jsonl([chat_line("a", "x")]))
    other = upload(c, b"data", purpose="user_data")
    keys_before = set(r.keys(PREFIX + "*"))
    count_before = r.zcard(PREFIX + "batches")
    cases = [
        (dict(input_file_id=f.id, endpoint="/v1/embeddings"), openai.BadRequestError, "endpoint"),
        (dict(input_file_id="file-" + "0" * 24, endpoint="/v1/chat/completions"), openai.NotFoundError,
         "input_file_id"),
        (dict(input_file_id="file-nope", endpoint="/v1/chat/completions"), openai.BadRequestError, "input_file_id"),
        (dict(input_file_id=f"{f.id}:content", endpoint="/v1/chat/completions"), openai.BadRequestError,
         "input_file_id"),
        (dict(input_file_id=other.id, endpoint="/v1/chat/completions"), openai.BadRequestError, "input_file_id"),
    ]
    for params, error, param in cases:
        with pytest.raises(error) as info:
            c.batches.create(completion_window="24h", **params)
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert info.value.body["param"] == "completion_window"
    for call in (c.batches.retrieve, c.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call("batch_" + "0" * 24)  # well formed, never issued
    assert set(r.keys(PREFIX + "*")) == keys_before and r.zcard(PREFIX + "batches") == count_before
    c.files.delete(f.id)
    c.files.delete(other.id)


def test_malformed_batch_ids_are_400_and_touch_nothing(jobs_system):
    c = jobs_system.client()
    r = jobs_system.redis.client()
    done, _ = wait_batch(c, create_batch(c, [chat_line("a", "x")]).id)
    keys_before = {k: r.type(k) for k in r.keys(PREFIX + "*")}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, param in [
        ("GET", f"/{done.id}:out", "batch_id"),  # names the key of batch `done`'s results
        ("POST", f"/{done.id}:err/cancel", "batch_id"),
        ("POST", "/batch_missing/cancel", "batch_id"),
        ("GET", f"/{done.id[:-1]}", "batch_id"),
        ("GET", "?after=batch_x", "after"),
    ]:
        reply = requests.request(method, f"{jobs_system.jobs_url}/v1/batches{path}", headers=auth, timeout=10)
        assert reply.status_code == 400, (method, path, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert {k: r.type(k) for k in r.keys(PREFIX + "*")} == keys_before
    assert c.batches.retrieve(done.id).status == "completed"


def test_cancel_keeps_results_and_stops_sending(jobs_system):
    c = jobs_system.client()
    lines = [chat_line(f"slow-{i}", f"slow {i}", x_delay=0.2) for i in range(60)]
    batch = create_batch(c, lines)
    wait_batch(c, batch.id, until=lambda b: b.request_counts.completed >= 8, timeout=20)
    with pytest.raises(openai.ConflictError) as info:
        c.files.delete(batch.input_file_id)  # in use by a running batch
    assert batch.id in info.value.message

    t0 = time.monotonic()
    cancelling = c.batches.cancel(batch.id)
    # The reply is the batch as read after the cancel: a worker may already have finished cancelling it.
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done, seen = wait_batch(c, batch.id, timeout=10)
    assert done.status == "cancelled" and time.monotonic() - t0 < 5, seen
    assert done.cancelled_at >= done.cancelling_at
    counts = done.request_counts
    out, err = read_lines(c, done.output_file_id), read_lines(c, done.error_file_id)
    assert 8 <= counts.completed == len(out) < 60 and counts.failed == len(err) == 0
    assert len({o["custom_id"] for o in out}) == len(out)

    time.sleep(0.5)  # let any request sent just before the cancel arrive
    sent = jobs_system.upstream.stats()["requests"]
    time.sleep(1.0)
    assert jobs_system.upstream.stats()["requests"] == sent  # no new items go out
    assert c.batches.cancel(batch.id).status == "cancelled"  # idempotent
    assert c.files.delete(batch.input_file_id).deleted


def test_cancel_of_a_finished_batch_is_a_conflict(jobs_system):
    c = jobs_system.client()
    done, _ = wait_batch(c, create_batch(c, [chat_line("one", "x")]).id)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(done.id)


def test_batch_listing_paginates_newest_first(jobs_system):
    c = jobs_system.client()
    ids = [create_batch(c, [chat_line("x", f"list {i}")]).id for i in range(3)]
    page = c.batches.list(limit=2)
    assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more
    nxt = c.batches.list(limit=2, after=ids[1])
    assert nxt.data[0].id == ids[0]
    assert [b.id for b in c.batches.list(limit=1)][:3] == ids[::-1]  # the client follows has_more
    for batch_id in ids:
        wait_batch(c, batch_id)


def test_cancel_a_5000_request_batch_after_10_seconds(jobs_system):
    c = jobs_system.client()
    lines = [chat_line(f"n{i}", f"item {i}", x_delay=0.05) for i in range(5000)]
    batch = create_batch(c, lines)
    time.sleep(10)
    running = c.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.request_counts.total == 5000
    assert running.request_counts.completed > 0
    c.batches.cancel(batch.id)
    done, seen = wait_batch(c, batch.id, timeout=15)
    assert done.status == "cancelled", seen
    counts = done.request_counts
    out, err = read_lines(c, done.output_file_id), read_lines(c, done.error_file_id)
    assert counts.total == 5000 and counts.completed + counts.failed <= 5000
    assert (counts.completed, counts.failed) == (len(out), len(err))
    assert len({line["custom_id"] for line in out + err}) == len(out) + len(err)
    assert counts.completed >= running.request_counts.completed
