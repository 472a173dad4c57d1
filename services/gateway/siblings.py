"""The other processes of this gateway (--gateway-workers N), for the admin routes that must act in all of them.

Each process answers its siblings on a Unix socket, `{index}.sock` in the gateway's private directory (made by
the parent, mode 0700: only this user reaches it), with a small internal app: a feature registers a call there
(`handle`) and makes it in every other process at once (`tell`). A weight update uses it to hold every
process's requests at the door (apis/admin/weights.py), /flush_cache to make every process forget the flushed
prefixes. One
update at a time over all the processes: `exclusive` takes an flock on a file of the same directory, which the
kernel releases if its holder dies.

A process that is not listening yet (the gateway is starting) is skipped by `tell`: it runs nothing yet. One
that stopped answering makes `tell` raise; the parent stops the whole gateway when a process dies.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

LOCK_POLL_S = 0.05


class LockTimeout(TimeoutError):
    """`exclusive` waited its whole timeout."""


class Siblings:
    def __init__(self, directory: str, index: int, count: int) -> None:
        self.directory = Path(directory)
        self.index, self.count = index, count
        self.internal = web.Application()
        self._runner: web.AppRunner | None = None

    def socket(self, index: int) -> Path:
        return self.directory / f"{index}.sock"

    def handle(self, name: str, handler: Callable[[dict], Awaitable[dict]]) -> None:
        """Answer the siblings' `name` calls with `handler(body)`."""
        async def route(request: web.Request) -> web.Response:
            return web.json_response(await handler(await request.json()))
        self.internal.router.add_post(f"/{name}", route)

    async def tell(self, name: str, body: dict, timeout_s: float) -> list[dict]:
        """Call `name` in every other process at once; the answers of those listening."""
        others = [i for i in range(1, self.count + 1) if i != self.index and self.socket(i).exists()]
        answers = await asyncio.gather(*(self._call(i, name, body, timeout_s) for i in others))
        return list(answers)

    async def ask(self, index: int, name: str, body: dict, timeout_s: float) -> dict:
        """Call `name` in process `index` (which may be this one) and return its answer."""
        return await self._call(index, name, body, timeout_s)

    async def _call(self, index: int, name: str, body: dict, timeout_s: float) -> dict:
        connector = aiohttp.UnixConnector(path=str(self.socket(index)))
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.post(f"http://gateway/{name}", json=body) as reply:
                reply.raise_for_status()
                return await reply.json()

    @contextlib.asynccontextmanager
    async def exclusive(self, name: str, timeout_s: float):
        """Held by one process of the gateway at a time (polled, so the event loop never blocks on it). The
        kernel frees it when its holder dies, not when it hangs: LockTimeout after waiting `timeout_s`."""
        fd = os.open(self.directory / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if asyncio.get_running_loop().time() > deadline:
                        raise LockTimeout(f"another process of this gateway has held {name!r} for over "
                                          f"{timeout_s:g} s") from None
                    await asyncio.sleep(LOCK_POLL_S)
            yield
        finally:
            os.close(fd)  # releases the lock

    async def start(self) -> None:
        self._runner = web.AppRunner(self.internal, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.socket(self.index))).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


SIBLINGS: web.AppKey[Siblings] = web.AppKey("siblings", Siblings)
