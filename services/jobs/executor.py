"""Runs one batch item against the gateway and turns the outcome into an output line.

Connection errors and 5xx replies are retried a few times with backoff; then (or on a timeout, or a 4xx)
the item ends as an error line. A 2xx reply is a success; anything else goes to the batch's error file.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
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

    async def run(self, url_path: str, body: str) -> Outcome:
        url = self.settings.gateway_url.rstrip("/") + url_path
        attempts = self.settings.retries + 1
        for attempt in range(1, attempts + 1):
            last = attempt == attempts
            try:
                async with self.session.post(url, data=body, headers={"Content-Type": "application/json"}) as reply:
                    text = await reply.text()
                    if reply.status >= 500 and not last:
                        log.info("gateway replied %d to %s (attempt %d/%d); retrying", reply.status, url_path,
                                 attempt, attempts)
                    else:
                        return Outcome(reply.status, parse_body(text))
            except asyncio.TimeoutError:
                return Outcome(None, None, {"code": "request_timeout", "message": f"The gateway did not answer "
                                            f"within {self.settings.request_timeout_s:g} s."})
            except aiohttp.ClientError as exc:
                if last:
                    return Outcome(None, None, {"code": "gateway_unreachable", "message": f"Could not reach the "
                                                f"gateway after {attempts} attempts: {exc}"})
                log.info("gateway unreachable for %s (attempt %d/%d): %s", url_path, attempt, attempts, exc)
            await asyncio.sleep(self.settings.backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")


def parse_body(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return {"error": {"message": text[:2000], "type": "invalid_response"}}
