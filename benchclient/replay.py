"""`pdserve bench --trace FILE`: a request trace replayed against a server at its arrival times.

Each request of the trace (Azure, Mooncake or BurstGPT: pdserve.planning.traces) is sent at its arrival time
from the start of the replay, whatever is still in flight (an open loop), as a streamed `/v1/completions` call
whose prompt is token ids of exactly the trace's input length and which generates exactly its output length
(`ignore_eos`). Mooncake's shared `hash_ids` blocks become the same token ids, so those prompts share prefixes
on the server as they did in the traced service. The results are one level of the usual table, labelled "trace".
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from pdserve.benchclient.load import Load, Target, stream_chat
from pdserve.benchclient.report import LevelSummary, RequestResult, redact, summarize
from pdserve.planning.traces import TraceRequest, prompt_ids


async def replay(target: Target, load: Load, requests: list[TraceRequest], on_error: Callable[[str], None],
                 vocab_span: int = 30000, on_done: Callable[[RequestResult], None] | None = None
                 ) -> LevelSummary:
    """Send every request at its arrival time; token ids from 1000 to 1000 + `vocab_span`."""
    load = replace(load, api="completions")
    connector = aiohttp.TCPConnector(limit=0)  # an open loop: never queue a request in the client
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(index: int, request: TraceRequest) -> RequestResult:
            ids = prompt_ids(request, index, span=vocab_span)
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result = await stream_chat(session, target, replace(load, output_len=max(1, request.output_len)), ids)
            if result.error:
                on_error(redact(result.error, target.api_key))
            if on_done:
                on_done(result)
            return result

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
    return summarize(0, list(results), duration, target.api_key)
