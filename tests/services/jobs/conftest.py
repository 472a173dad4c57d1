"""Fixtures for the jobs service tests: one shared system (redis-server, test upstream, `pdserve jobs` with
one supervised batch worker) for the API tests; durability tests start their own processes."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from jobs_harness import CONCURRENCY, MAX_FILE_SIZE, RETRIES, RedisServer, Upstream, client, start_jobs  # noqa: E402


@dataclass
class System:
    redis: RedisServer
    upstream: Upstream
    jobs_url: str

    def client(self, api_key: str | None = None):
        return client(self.jobs_url) if api_key is None else client(self.jobs_url, api_key)


@pytest.fixture(scope="session")
def jobs_system(tmp_path_factory):
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    upstream = Upstream(delay=0.02).start()
    jobs = None
    try:
        jobs, url = start_jobs(redis_server.url(), upstream.url, "--batch-workers", "1", "--concurrency",
                               str(CONCURRENCY), "--max-file-size", str(MAX_FILE_SIZE), "--lease-seconds", "3",
                               "--retries", str(RETRIES))
        yield System(redis_server, upstream, url)
    finally:
        if jobs is not None:
            jobs.stop()
        upstream.stop()
        redis_server.stop()
