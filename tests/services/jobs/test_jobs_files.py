"""OpenAI Files on the real jobs service (real redis-server, official openai client): upload, list, read,
delete, the size limit, bad input, and the API key."""
from __future__ import annotations

import urllib.request

import openai
import pytest
import requests

from jobs_harness import API_KEY, MAX_FILE_SIZE, PREFIX, chat_line, jsonl, upload


def test_file_lifecycle(jobs_system):
    c = jobs_system.client()
    content = jsonl([chat_line("a", "hello"), chat_line("b", "world")])
    created = upload(c, content, name="requests.jsonl")
    assert created.object == "file" and created.id.startswith("file-")
    assert (created.bytes, created.filename, created.purpose) == (len(content), "requests.jsonl", "batch")
    assert created.created_at > 0

    got = c.files.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    assert c.files.content(created.id).read() == content
    assert created.id in [f.id for f in c.files.list(purpose="batch")]

    deleted = c.files.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "file")
    for call in (c.files.retrieve, c.files.content, c.files.delete):
        with pytest.raises(openai.NotFoundError) as info:
            call(created.id)
        assert created.id in info.value.message
    assert created.id not in [f.id for f in c.files.list()]
    assert not jobs_system.redis.client().keys(f"{PREFIX}file:{created.id}*")


def test_binary_file_round_trips(jobs_system):
    c = jobs_system.client()
    content = bytes(range(256)) * 10
    created = upload(c, content, name="blob.bin", purpose="user_data")
    assert c.files.content(created.id).read() == content
    c.files.delete(created.id)


def test_file_too_large_is_refused_and_not_stored(jobs_system):
    c = jobs_system.client()
    before = jobs_system.redis.client().zcard(PREFIX + "files")
    with pytest.raises(openai.APIStatusError) as info:
        upload(c, b"x" * (MAX_FILE_SIZE + 1))
    assert info.value.status_code == 413
    error = info.value.body
    assert error["param"] == "file" and error["code"] == "file_too_large"
    assert "limit" in error["message"]
    assert jobs_system.redis.client().zcard(PREFIX + "files") == before
    # Exactly at the limit is fine.
    at_limit = upload(c, b"y" * MAX_FILE_SIZE, name="big.txt", purpose="user_data")
    assert at_limit.bytes == MAX_FILE_SIZE
    c.files.delete(at_limit.id)


def test_bad_purpose_names_the_field(jobs_system):
    with pytest.raises(openai.BadRequestError) as info:
        upload(jobs_system.client(), b"{}\n", purpose="nonsense")
    assert info.value.body["param"] == "purpose"
    assert "nonsense" in info.value.body["message"]


def test_file_listing_paginates_newest_first(jobs_system):
    c = jobs_system.client()
    ids = [upload(c, f"{i}\n".encode(), name=f"f{i}.txt", purpose="vision").id for i in range(3)]
    page = c.files.list(purpose="vision", limit=2)
    assert [f.id for f in page.data] == [ids[2], ids[1]] and page.has_more
    rest = c.files.list(purpose="vision", limit=2, after=ids[1])
    assert [f.id for f in rest.data] == [ids[0]] and not rest.has_more
    assert [f.id for f in c.files.list(purpose="vision", order="asc")] == ids
    assert [f.id for f in c.files.list(purpose="vision", limit=1)] == ids[::-1]  # the client follows has_more
    with pytest.raises(openai.BadRequestError) as info:
        c.files.list(limit=0)
    assert info.value.body["param"] == "limit"
    for file_id in ids:
        c.files.delete(file_id)


def test_api_key_is_required_except_for_health(jobs_system):
    with pytest.raises(openai.AuthenticationError):
        jobs_system.client(api_key="wrong").files.list()
    with pytest.raises(openai.AuthenticationError):
        jobs_system.client(api_key="wrong").batches.list()
    with urllib.request.urlopen(f"{jobs_system.jobs_url}/health", timeout=5) as r:
        assert r.status == 200 and r.read() == b"ok"


def test_malformed_file_ids_are_400_and_touch_nothing(jobs_system):
    c = jobs_system.client()
    r = jobs_system.redis.client()
    content = jsonl([chat_line("a", "hello")])
    f = upload(c, content)
    keys_before = {k: r.type(k) for k in r.keys(PREFIX + "*")}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    base = f"{jobs_system.jobs_url}/v1/files"
    for method, path, param in [
        ("DELETE", f"/{f.id}:content", "file_id"),  # would name the content key of file f
        ("DELETE", f"/{f.id}:users", "file_id"),
        ("GET", f"/{f.id}:content", "file_id"),
        ("GET", f"/{f.id}:content/content", "file_id"),
        ("DELETE", f"/{f.id.upper()}", "file_id"),
        ("DELETE", "/file-*", "file_id"),
        ("GET", f"?after={f.id}:x", "after"),
    ]:
        reply = requests.request(method, base + path, headers=auth, timeout=10)
        assert reply.status_code == 400, (method, path, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert {k: r.type(k) for k in r.keys(PREFIX + "*")} == keys_before
    assert c.files.content(f.id).read() == content and c.files.retrieve(f.id).bytes == len(content)
    unknown = "file-" + "0" * 24  # well formed, never issued: 404 as for any file that does not exist
    for call in (c.files.retrieve, c.files.content, c.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(unknown)
    assert c.files.delete(f.id).deleted
