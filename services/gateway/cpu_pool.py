"""The gateway's own bounded thread pool for the large work at its door: decoding large JSON bodies, tokenizing
and chat-template rendering of large inputs, building and encoding large answers (many logprobs).

The event loop serves every client: tokenizing a prompt of hundreds of kilobytes, rendering thousands of chat
messages, decoding megabytes of JSON or formatting the logprobs of thousands of tokens takes it away from all of
them for up to seconds (and /live with it, which a liveness probe reads as a hung gateway). Work below
OFFLOAD_CHARS runs inline, where a thread hop would cost more than the work; larger work runs here, a few at a time.
Fast tokenizers release the GIL while they encode; Jinja and Python code do not, but the loop still gets the
interpreter every switch interval; a C JSON codec holds it to the end of its call, which orjson keeps short. The
pool is its own, not asyncio's default executor, which DNS lookups and grammar compiles share.

Bounds, so that a few clients sending costly bodies cannot queue everyone else's work behind theirs:
- at most `threads + queue` jobs are held at once (running or waiting); one more is refused at once with 429 and
  Retry-After. A job is held until its thread is done with it, whether or not its request still waits for it.
- each job has a deadline (`deadline_s` from its submission): a request whose work is not done by then gets 503
  with Retry-After. Work that checks `check_deadline()` as it goes (the JSON decoder's hooks) stops there and
  frees its thread; a job still waiting is taken out of the queue, as it is when its handler is cancelled.
"""
from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from aiohttp import web

from pdserve.services.gateway.api_error import Busy

T = TypeVar("T")
OFFLOAD_CHARS = 8192  # characters or token ids of input (entries of an answer) below which work runs inline
DEFAULT_THREADS = 2
DEFAULT_QUEUE = 64  # jobs that may wait beyond those running
DEFAULT_DEADLINE_S = 10.0


class Overdue(Exception):
    """Raised inside a job by `check_deadline` once its deadline has passed or its request gave up on it."""


class _Job:
    __slots__ = ("deadline", "abandoned")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.abandoned = False


_running = threading.local()  # the job this pool thread runs (`job`), for check_deadline


def check_deadline() -> None:
    """Overdue when the pool job calling it is past its deadline or abandoned; nothing outside a pool job. Costs
    about a tenth of a microsecond: long work calls it every few thousand steps."""
    job = getattr(_running, "job", None)
    if job is not None and (job.abandoned or time.monotonic() > job.deadline):
        raise Overdue


def _run_job(job: _Job, fn: Callable[[], T]) -> T:
    if job.abandoned:
        raise Overdue
    _running.job = job
    try:
        return fn()
    finally:
        _running.job = None


class CpuPool:
    def __init__(self, threads: int = DEFAULT_THREADS, queue: int = DEFAULT_QUEUE,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if threads < 1 or queue < 0 or deadline_s <= 0:
            raise ValueError("the CPU pool needs at least one thread, a queue of 0 or more and a positive deadline "
                             f"(got {threads} threads, --cpu-pool-queue {queue}, --cpu-pool-deadline {deadline_s})")
        self.threads, self.queue, self.deadline_s = threads, queue, deadline_s
        self.held = 0  # jobs submitted whose thread is not done with them yet (changed on the event loop only)
        self._executor: ThreadPoolExecutor | None = None  # threads start at the first large input

    async def run(self, size: int, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs), inline when `size` (characters or ids of input) is small, else on the pool: Busy
        429 when the pool holds all it may, Busy 503 past the deadline."""
        if size < OFFLOAD_CHARS:
            return fn(*args, **kwargs)
        if self.held >= self.threads + self.queue:
            raise Busy(429, f"The gateway's CPU pool is full ({self.threads} running, {self.queue} waiting: "
                            "--cpu-pool-queue): send the request again shortly.", 1)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="pdserve-tokenize")
        loop = asyncio.get_running_loop()
        job = _Job(time.monotonic() + self.deadline_s)
        future = self._executor.submit(_run_job, job, functools.partial(fn, *args, **kwargs))
        self.held += 1
        future.add_done_callback(lambda _: _call_soon(loop, self._release))
        try:
            async with asyncio.timeout_at(loop.time() + self.deadline_s):
                return await asyncio.wrap_future(future)
        except (TimeoutError, Overdue):
            raise Busy(503, f"The gateway could not do this request's work within {self.deadline_s:g} s "
                            "(--cpu-pool-deadline): the gateway is busy, or the input is too large.", 2) from None
        finally:
            job.abandoned = True  # a waiting job is cancelled with the wrapper; a running one stops at its check

    def _release(self) -> None:
        self.held -= 1

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop closed while the job ran: nobody counts any more
        pass


CPU_POOL = web.AppKey("cpu_pool", CpuPool)  # the app's pool, for code that sees the request and not the Gateway
