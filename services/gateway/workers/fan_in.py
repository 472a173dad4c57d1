"""The updates of several generations of one request (n prompts, or n choices sent as separate generations) as
they come, tagged with each generation's position: one consumer, and every generation stopped when it stops."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from pdserve.services.gateway.workers.generation import Generation
from pdserve.services.gateway.workers.job import Update


async def merge_updates(gens: list[Generation]) -> AsyncIterator[tuple[int, Update]]:
    """Updates of several generations as they come, tagged with the generation's position."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0].updates()) as updates:
            async for u in updates:
                yield 0, u
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, gen: Generation) -> None:
        try:
            async with contextlib.aclosing(gen.updates()) as updates:
                async for u in updates:
                    queue.put_nowait((k, u))
            queue.put_nowait((k, None))
        except Exception as exc:  # handed to the consumer, which stops everything
            queue.put_nowait((k, exc))

    tasks = [asyncio.create_task(pump(k, g)) for k, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
