"""Graceful stop for the long-running services: SIGTERM and SIGINT set the event their serve loop awaits."""
from __future__ import annotations

import asyncio
import signal


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
