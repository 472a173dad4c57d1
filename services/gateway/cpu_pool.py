"""The gateway's own bounded thread pool for the large work at its door: decoding large JSON bodies, tokenizing
and chat-template rendering of large inputs, building and encoding large answers (many logprobs).

The event loop serves every client: tokenizing a prompt of hundreds of kilobytes, rendering thousands of chat
messages, decoding megabytes of JSON or formatting the logprobs of thousands of tokens takes it away from all of
them for up to seconds (and /live with it, which a liveness probe reads as a hung gateway). Work below
OFFLOAD_CHARS runs inline, where a thread hop would cost more than the work; larger work runs here, a few at a time.
Fast tokenizers release the GIL while they encode; Jinja and Python code do not, but the loop still gets the
interpreter every switch interval; a C JSON codec holds it to the end of its call, which orjson keeps short. The
pool is its own, not asyncio's default executor, which DNS lookups and grammar compiles share. A handler cancelled
while its work waits here takes the work out of the queue.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from aiohttp import web

T = TypeVar("T")
OFFLOAD_CHARS = 8192  # characters or token ids of input (entries of an answer) below which work runs inline
DEFAULT_THREADS = 2


class CpuPool:
    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None  # threads start at the first large input

    async def run(self, size: int, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs), inline when `size` (characters or ids of input) is small, else on the pool."""
        if size < OFFLOAD_CHARS:
            return fn(*args, **kwargs)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="pdserve-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


CPU_POOL = web.AppKey("cpu_pool", CpuPool)  # the app's pool, for code that sees the request and not the Gateway
