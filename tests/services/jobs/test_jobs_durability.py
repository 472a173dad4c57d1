"""Crashes mid-batch with real processes: a batch worker SIGKILLed (another one, or its restarted
replacement, finishes the batch) or frozen past its lease, Redis stopped and restarted from its append-only
file, no worker running at all, and a batch that outlives its completion window. In every case each
custom_id appears exactly once in the output."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest

from jobs_harness import (RedisServer, Upstream, batch_keys, chat_line, client, create_batch, kill_pid,
                          read_lines, start_jobs, start_worker, wait_batch)

LEASE = "2"


@pytest.fixture(scope="module")
def slow_upstream():
    upstream = Upstream(delay=0.1).start()
    yield upstream
    upstream.stop()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def procs():
    started = []
    yield started
    for proc in reversed(started):
        proc.stop()


def lines_for(tag: str, n: int) -> list[dict]:
    return [chat_line(f"{tag}-{i}", f"{tag} prompt {i}") for i in range(n)]


def assert_exactly_once(c, batch, lines: list[dict]) -> list[dict]:
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": len(lines), "completed": len(lines), "failed": 0}
    out = read_lines(c, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    expected = {line["custom_id"]: line["body"]["messages"][-1]["content"][::-1] for line in lines}
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] == expected[o["custom_id"]] for o in out)
    return out


def child_pids(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def test_sigkilled_worker_batch_is_finished_by_another(redis_server, slow_upstream, procs):
    url = redis_server.url()
    jobs, base = start_jobs(url, slow_upstream.url, "--batch-workers", "0")
    procs.append(jobs)
    doomed = start_worker(url, slow_upstream.url, "--concurrency", "4", "--lease-seconds", LEASE)
    procs.append(doomed)
    c = client(base)
    lines = lines_for("kill", 40)
    sent_before = slow_upstream.stats()["requests"]
    batch = create_batch(c, lines)
    wait_batch(c, batch.id, until=lambda b: b.request_counts.completed >= 8, timeout=30)
    deadline = time.monotonic() + 10  # between two items the worker may have none out: kill it with one out
    while slow_upstream.stats()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    doomed.kill()  # SIGKILL with items in flight
    stalled = c.batches.retrieve(batch.id)
    assert stalled.status == "in_progress" and stalled.request_counts.completed < 40

    procs.append(start_worker(url, slow_upstream.url, "--concurrency", "4", "--lease-seconds", LEASE))
    done, _ = wait_batch(c, batch.id, timeout=40)
    assert_exactly_once(c, done, lines)
    # The requests in flight when the worker died were sent again, yet appear once in the output.
    stats = slow_upstream.stats()
    assert stats["requests"] - sent_before > 40
    assert all(stats["by_prompt"][line["body"]["messages"][-1]["content"]] >= 1 for line in lines)


def test_paused_worker_loses_its_lease_and_its_late_results_are_dropped(redis_server, slow_upstream, procs):
    """A worker frozen past its lease (SIGSTOP) has its items taken over; when it wakes up and records the
    same items, the duplicates are dropped."""
    url = redis_server.url()
    jobs, base = start_jobs(url, slow_upstream.url, "--batch-workers", "0")
    procs.append(jobs)
    frozen = start_worker(url, slow_upstream.url, "--concurrency", "4", "--lease-seconds", LEASE)
    procs.append(frozen)
    c = client(base)
    lines = lines_for("pause", 240)
    sent_before = slow_upstream.stats()["requests"]
    batch = create_batch(c, lines)
    wait_batch(c, batch.id, until=lambda b: b.request_counts.completed >= 4, timeout=30)
    os.kill(frozen.popen.pid, signal.SIGSTOP)
    try:
        procs.append(start_worker(url, slow_upstream.url, "--concurrency", "4", "--lease-seconds", LEASE))
        time.sleep(float(LEASE) + 1.5)  # the frozen worker's lease lapses and its items run elsewhere
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    running = c.batches.retrieve(batch.id)
    assert running.status == "in_progress", running  # both workers now record results side by side
    done, _ = wait_batch(c, batch.id, timeout=40)
    assert_exactly_once(c, done, lines)
    assert slow_upstream.stats()["requests"] - sent_before > 240


def test_supervised_worker_is_restarted_and_finishes(redis_server, slow_upstream, procs):
    jobs, base = start_jobs(redis_server.url(), slow_upstream.url, "--batch-workers", "1", "--concurrency", "4",
                            "--lease-seconds", LEASE)
    procs.append(jobs)
    c = client(base)
    lines = lines_for("restart", 30)
    batch = create_batch(c, lines)
    wait_batch(c, batch.id, until=lambda b: b.request_counts.completed >= 5, timeout=30)
    [worker_pid] = child_pids(jobs.popen.pid)
    kill_pid(worker_pid)
    done, _ = wait_batch(c, batch.id, timeout=40)
    assert_exactly_once(c, done, lines)
    [replacement] = child_pids(jobs.popen.pid)
    assert replacement != worker_pid


def test_redis_restart_mid_batch_resumes(redis_server, slow_upstream, procs):
    jobs, base = start_jobs(redis_server.url(), slow_upstream.url, "--batch-workers", "1", "--concurrency", "4",
                            "--lease-seconds", LEASE)
    procs.append(jobs)
    c = client(base)
    lines = lines_for("redis", 60)
    batch = create_batch(c, lines)
    wait_batch(c, batch.id, until=lambda b: b.request_counts.completed >= 10, timeout=30)

    redis_server.stop()  # SIGTERM: the append-only file is complete
    with pytest.raises(openai.InternalServerError) as info:
        c.batches.retrieve(batch.id)
    assert info.value.status_code == 503 and info.value.body["code"] == "storage_unavailable"
    time.sleep(1.0)  # items finishing now wait for Redis to record their results
    redis_server.start()

    done, _ = wait_batch(c, batch.id, timeout=40)
    assert_exactly_once(c, done, lines)
    assert batch_keys(redis_server.client(), batch.id) == {
        "items": 0, "out": 0, "err": 0, "file_users": 0, "deadline": None}


def test_redis_sigkilled_mid_batch_loses_and_repeats_nothing(redis_server, slow_upstream, procs):
    jobs, base = start_jobs(redis_server.url(), slow_upstream.url, "--batch-workers", "1", "--concurrency", "4",
                            "--lease-seconds", LEASE)
    procs.append(jobs)
    c = client(base)
    lines = lines_for("sigkill", 60)
    batch = create_batch(c, lines)
    seen, _ = wait_batch(c, batch.id, until=lambda b: b.request_counts.completed >= 10, timeout=30)
    redis_server.kill()  # no shutdown, no final write: what it acknowledged is on disk already
    time.sleep(1.0)
    redis_server.start()
    after = c.batches.retrieve(batch.id)
    assert after.request_counts.completed >= seen.request_counts.completed  # nothing it had recorded is lost

    done, _ = wait_batch(c, batch.id, timeout=40)
    assert_exactly_once(c, done, lines)
    assert batch_keys(redis_server.client(), batch.id) == {
        "items": 0, "out": 0, "err": 0, "file_users": 0, "deadline": None}


def test_batch_past_its_window_expires_with_partial_output(redis_server, slow_upstream, procs):
    jobs, base = start_jobs(redis_server.url(), slow_upstream.url, "--batch-workers", "1", "--concurrency", "2",
                            "--completion-window-seconds", "3")
    procs.append(jobs)
    c = client(base)
    wait_batch(c, create_batch(c, [chat_line("warm-up", "x")]).id)  # the worker is up and running
    lines = [chat_line(f"exp-{i}", f"expiring {i}", x_delay=0.3) for i in range(40)]
    batch = create_batch(c, lines)
    assert batch.expires_at == batch.created_at + 3
    done, seen = wait_batch(c, batch.id, timeout=15)
    assert done.status == "expired", seen
    assert done.expired_at >= batch.expires_at
    out = read_lines(c, done.output_file_id)
    assert 0 < done.request_counts.completed == len(out) < 40
    assert len({o["custom_id"] for o in out}) == len(out)
    assert c.files.delete(batch.input_file_id).deleted


def test_batches_wait_for_a_worker_and_cancel_while_validating(redis_server, slow_upstream, procs):
    url = redis_server.url()
    jobs, base = start_jobs(url, slow_upstream.url, "--batch-workers", "0")
    procs.append(jobs)
    c = client(base)
    kept = create_batch(c, lines_for("kept", 5))
    dropped = create_batch(c, lines_for("dropped", 5))
    time.sleep(0.5)
    assert c.batches.retrieve(kept.id).status == "validating"  # no worker yet: nothing is lost, it waits
    cancelling = c.batches.cancel(dropped.id)
    assert cancelling.status == "cancelling"

    procs.append(start_worker(url, slow_upstream.url, "--concurrency", "4"))
    assert_exactly_once(c, wait_batch(c, kept.id, timeout=30)[0], lines_for("kept", 5))
    cancelled, _ = wait_batch(c, dropped.id, timeout=30)
    assert cancelled.status == "cancelled" and cancelled.in_progress_at is None
    assert cancelled.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
    assert cancelled.output_file_id is None and cancelled.error_file_id is None
    assert not any("dropped" in prompt for prompt in slow_upstream.stats()["by_prompt"])
    assert batch_keys(redis_server.client(), dropped.id) == {
        "items": 0, "out": 0, "err": 0, "file_users": 0, "deadline": None}
