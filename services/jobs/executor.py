"""Runs one batch item against the gateway and turns the outcome into an output line.

A busy gateway is waited for: a 429, or a 503 that says when to come back (Retry-After: no worker ready, a
gateway shutting down), is tried again after that long (or a growing backoff), for up to `busy_patience_s`.
Other 5xx replies and connection errors are retried `retries` times with backoff; then (or on a timeout, or a
4xx) the item ends as an error line. A 2xx reply is a success; anything else goes to the batch's error file.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("pdserve.jobs.executor")


@dataclass(frozen=True)
class Outcome:
    status_code: int | None  # None: no HTTP reply at all
    body: object
    error: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    def line(self, custom_id: str) -> str:
        response = None
        if self.status_code is not None:
            response = {"status_code": self.status_code, "request_id": f"req_{secrets.token_hex(12)}",
                        "body": self.body}
        return json.dumps({"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
                           "response": response, "error": self.error}, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ExecutorSettings:
    gateway_url: str
    api_key: str | None = None
    concurrency: int = 32
    request_timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 0.5
    busy_patience_s: float = 3600.0  # how long one item keeps trying again while the gateway is busy
    max_busy_wait_s: float = 30.0  # the longest wait between two such tries, whatever Retry-After says


class Executor:
    def __init__(self, settings: ExecutorSettings) -> None:
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        self.session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(limit=self.settings.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s, connect=10))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def run(self, url_path: str, body: str, traceparent: str = "") -> Outcome:
        """`traceparent`: the item's span, which the gateway's trace of the request continues."""
        s = self.settings
        url = s.gateway_url.rstrip("/") + url_path
        attempts = s.retries + 1
        failures = busy = 0  # failed tries (at most `attempts`), and busy replies waited out so far
        start = time.monotonic()
        while True:
            try:
                headers = {"Content-Type": "application/json", **({"traceparent": traceparent} if traceparent else {})}
                async with self.session.post(url, data=body, headers=headers) as reply:
                    status, text, retry_after = reply.status, await reply.text(), retry_after_s(reply.headers)
            except asyncio.TimeoutError:
                return Outcome(None, None, {"code": "request_timeout", "message": f"The gateway did not answer "
                                            f"within {s.request_timeout_s:g} s."})
            except aiohttp.ClientError as exc:
                failures += 1
                if failures == attempts:
                    return Outcome(None, None, {"code": "gateway_unreachable", "message": f"Could not reach the "
                                                f"gateway after {attempts} attempts: {exc}"})
                log.info("gateway unreachable for %s (attempt %d/%d): %s", url_path, failures, attempts, exc)
                await asyncio.sleep(self.backoff(failures))
                continue
            if is_busy(status, retry_after) and time.monotonic() - start < s.busy_patience_s:
                busy += 1
                wait = min(retry_after if retry_after is not None else self.backoff(busy), s.max_busy_wait_s)
                wait *= random.uniform(1.0, 1.25)  # items refused together do not all come back together
                log.info("gateway busy (%d) for %s; trying again in %.1f s", status, url_path, wait)
                await asyncio.sleep(wait)
                continue
            if status >= 500 and failures + 1 < attempts:
                failures += 1
                log.info("gateway replied %d to %s (attempt %d/%d); retrying", status, url_path, failures, attempts)
                await asyncio.sleep(self.backoff(failures))
                continue
            return Outcome(status, parse_body(text))

    def backoff(self, tries: int) -> float:
        return min(self.settings.backoff_s * 2 ** (tries - 1), self.settings.max_busy_wait_s)


def is_busy(status: int, retry_after: float | None) -> bool:
    """A reply that asks to come back later rather than reporting a failure."""
    return status == 429 or (status == 503 and retry_after is not None)


def retry_after_s(headers) -> float | None:
    """Retry-After in seconds (the delay form; an HTTP date counts as absent)."""
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except ValueError:
        return None


def parse_body(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return {"error": {"message": text[:2000], "type": "invalid_response"}}
