"""The gateway's CPU pool holds its bounds: a queue past its limit is refused at once (429, Retry-After), work not
done by its deadline is a 503 with Retry-After, and work that checks its deadline stops and frees its thread."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from pdserve.services.gateway.api_error import Busy
from pdserve.services.gateway.cpu_pool import OFFLOAD_CHARS, CpuPool, check_deadline
from pdserve.services.gateway.json_codec import decode

BIG = OFFLOAD_CHARS  # a size that goes to the pool


def test_a_full_pool_refuses_with_429_at_once_and_takes_work_again_once_it_drains():
    async def main():
        pool = CpuPool(threads=1, queue=1, deadline_s=30)
        gate = threading.Event()
        running = [asyncio.ensure_future(pool.run(BIG, gate.wait)) for _ in range(2)]  # one runs, one waits
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(Busy) as info:
            await pool.run(BIG, lambda: "third")
        assert time.monotonic() - start < 0.1
        assert info.value.status == 429 and info.value.retry_after_s >= 1
        assert "--cpu-pool-queue" in info.value.message
        assert info.value.response().headers["Retry-After"] == str(info.value.retry_after_s)
        assert await pool.run(10, lambda: "small work runs inline") == "small work runs inline"
        gate.set()
        assert await asyncio.gather(*running) == [True, True]
        await asyncio.sleep(0.01)
        assert pool.held == 0 and await pool.run(BIG, lambda: "again") == "again"
        pool.close()

    asyncio.run(main())


def test_work_past_its_deadline_is_503_and_work_that_checks_stops():
    async def main():
        pool = CpuPool(threads=1, queue=4, deadline_s=0.3)
        stopped = threading.Event()

        def checking():
            while True:
                try:
                    check_deadline()
                except Exception:
                    stopped.set()
                    raise
                time.sleep(0.01)

        start = time.monotonic()
        with pytest.raises(Busy) as info:
            await pool.run(BIG, checking)
        assert 0.25 < time.monotonic() - start < 2
        assert info.value.status == 503 and info.value.retry_after_s >= 1
        assert "--cpu-pool-deadline" in info.value.message
        assert stopped.wait(2)  # the thread is free again: the next job runs
        assert await pool.run(BIG, lambda: 7) == 7
        await asyncio.sleep(0.01)
        assert pool.held == 0
        pool.close()

    asyncio.run(main())


def test_a_large_body_of_long_integers_stops_decoding_at_the_deadline():
    # 20-digit integers take the standard library's decoder with a Python hook per number (json_codec): seconds
    # for a few megabytes. Past the deadline the decoder stops, rather than holding a thread to the end.
    raw = json.dumps({"pad": [10**19 + i for i in range(800_000)]}).encode()

    async def main():
        pool = CpuPool(threads=1, queue=0, deadline_s=0.05)
        start = time.monotonic()
        with pytest.raises(Busy):
            await pool.run(len(raw), decode, raw, True)
        await asyncio.sleep(0.2)
        assert pool.held == 0, "the decoder still holds the thread"
        assert time.monotonic() - start < 0.6
        pool.close()

    asyncio.run(main())
