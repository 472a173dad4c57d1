"""The calls between the processes of one gateway (--gateway-workers), on real Unix sockets in one event loop; the
processes' routers are real, over worker pools whose health is set by hand."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from aiohttp import web
from test_router import make_pool, prompt

from pdserve.services.gateway.apis import native as native_api
from pdserve.services.gateway.apis.context import GATEWAY
from pdserve.services.gateway.workers.router import Router
from pdserve.services.gateway.siblings import SIBLINGS, LockTimeout, Siblings


async def test_a_worker_flushed_through_one_process_loses_its_prefixes_in_the_others_routers(tmp_path):
    # A flushed worker's prefixes are gone: no process may keep sending those prompts to it by affinity.
    processes = []
    for index in (1, 2):
        router = Router(make_pool("colocated", {"colocated": 2}))
        app = web.Application()
        app[GATEWAY] = SimpleNamespace(backend=SimpleNamespace(router=router))
        app[SIBLINGS] = siblings = Siblings(str(tmp_path), index, 2)
        native_api.add_routes(app)  # registers what the siblings may ask
        await siblings.start()
        processes.append((router, siblings))
    (_, first), (router, _) = processes
    try:
        owner = router.choose(prompt(1)).generate.address
        kept = router.choose(prompt(2), exclude=frozenset({owner})).generate.address
        assert owner in router.prefixes.values() and kept in router.prefixes.values()
        await first.tell("forget", {"addresses": [owner]}, timeout_s=5)
        assert owner not in router.prefixes.values() and kept in router.prefixes.values()
    finally:
        for _, siblings in processes:
            await siblings.close()


async def test_a_lock_held_by_a_process_that_hangs_is_given_up_after_its_timeout(tmp_path):
    holder, waiter = Siblings(str(tmp_path), 1, 2), Siblings(str(tmp_path), 2, 2)
    async with holder.exclusive("weights", timeout_s=1):
        with pytest.raises(LockTimeout, match="held 'weights'"):
            async with waiter.exclusive("weights", timeout_s=0.2):
                raise AssertionError("two processes held the lock at once")
    async with waiter.exclusive("weights", timeout_s=1):  # free again once the holder let go
        pass
