"""The gateway's read-only state that every handler shares: the door to the workers (`backend`), the intake's
checks of a request's inputs (`inputs`), what it serves and how it is set up; and the answers: the SSE response,
and `json_answer`, which builds and writes a large answer off the event loop.

Built once by `app.create_app`; handlers reach it as `request.app[GATEWAY]`.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from aiohttp import web

from pdserve.services.gateway.cpu_pool import OFFLOAD_CHARS, CpuPool
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.inputs import GRAMMAR_COMPILE_TIMEOUT_S, Inputs
from pdserve.services.gateway.json_codec import encode
from pdserve.services.gateway.limits import Limits
from pdserve.services.gateway.tokenization import ModelConfigInfo, ModelTokenizer
from pdserve.services.gateway.workers.adapters import UnknownModel, adapter_of, lora_enabled, refresh_adapters
from pdserve.services.gateway.workers.backend import Backend
from pdserve.services.gateway.workers.planning import PlannerLoop
from pdserve.services.gateway.workers.pool import Worker


# What /get_model_info reports as `weight_version`: the label is the weights admin route's state (an update
# changes it), so that route installs its reader here and the route reporting it imports no other route.
WEIGHT_VERSION: web.AppKey[Callable[[], str]] = web.AppKey("weight_version")
# The HTTP client session to the jobs service (jobs_proxy.py opens and closes it; the status page reads through it).
JOBS_SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("jobs_session", aiohttp.ClientSession)


@dataclass
class Gateway:
    backend: Backend
    tokenizer: ModelTokenizer
    served_model_name: str
    model_path: str  # as given (reported by /get_model_info)
    tokenizer_path: str
    model_config: ModelConfigInfo
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None  # a tool_parsers.PARSERS name
    enable_cache_report: bool = False
    api_key: str | None = None
    # Admin routes (app.ADMIN_PATHS) need this key; without one they are refused, unless `open_admin_routes`
    # lets them take the API key (or none) as before.
    admin_api_key: str | None = None
    open_admin_routes: bool = False
    jobs_url: str | None = None
    server_args: dict = field(default_factory=dict)  # for /get_server_info (never a key)
    accepted_model_names: frozenset[str] = frozenset()
    # --served-model-name given: a request naming another model is refused (400), as SGLang does; without it any
    # `model` is served by this one
    strict_model_name: bool = False
    is_embedding: bool = False  # --is-embedding: a decoder served for its embeddings, not to generate
    created: int = field(default_factory=lambda: int(time.time()))
    inflate_bodies: bool = False  # --inflate-request-bodies: gzip and deflate bodies taken (bodies.py)
    limits: Limits = field(default_factory=Limits)  # what one request may ask (limits.py)
    cpu: CpuPool = field(default_factory=CpuPool)  # tokenizing and rendering of large inputs, off the event loop
    grammar_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S  # budget of one grammar's compile (400 past it)
    # --responses-incomplete-status: a response cut by max_output_tokens is OpenAI's `incomplete`, not SGLang's
    # `completed` (responses/output.py `outcome`)
    responses_incomplete_status: bool = False
    planner: PlannerLoop | None = None  # --planner slo (workers/planning.py): runs while the app does
    inputs: Inputs = field(init=False)

    def __post_init__(self) -> None:
        self.inputs = Inputs(self.tokenizer, self.model_config, self.tokenizer_path, self.backend.context_length,
                             self.limits, self.cpu, self.grammar_timeout_s)

    async def check_model(self, name: str | None) -> None:
        """Whether a request may name `name` (no name means the served model; a loaded LoRA adapter, which shares
        the base model's tokenizer, is served too): see `adapter_of`."""
        await self.adapter_of(name)

    async def adapter_of(self, model: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request names by `model` or `lora_path` (None: the base model); see adapters.py.
        One this process does not know is looked for again on the workers before it is refused. A `model` that
        names nothing served is SGLang's: a 400 when --served-model-name was given, else the base model serves
        the request whatever its `model` says."""
        if model in self.accepted_model_names and lora_path is None:
            return None
        workers = self.backend.serving_workers()
        try:
            return self._adapter_of(model, lora_path, workers)
        except ApiError:
            if not lora_enabled(workers):
                return self._unknown_model(model, lora_path, workers)
        # Another process of this gateway, or another replica, may have loaded it since this one last asked.
        await refresh_adapters(workers, self.backend.settings.rpc_timeout_s)
        return self._unknown_model(model, lora_path, workers)

    def _unknown_model(self, model: str | None, lora_path: str | None, workers: list[Worker]) -> str | None:
        try:
            return self._adapter_of(model, lora_path, workers)
        except UnknownModel:
            if self.strict_model_name:
                raise
        return self._adapter_of(None, lora_path, workers)

    def _adapter_of(self, model: str | None, lora_path: str | None, workers: list[Worker]) -> str | None:
        return adapter_of(model, lora_path, served=self.served_model_name, accepted=self.accepted_model_names,
                          workers=workers)

    def reported_cached(self, cached: int) -> int:
        """Cached prompt tokens where an API's shape always has the field (Responses' input_tokens_details,
        Messages' cache_read_input_tokens): the count with --enable-cache-report, else 0. Prompts of every client
        answer from one cache: the count for a guessed prompt tells how much of it another client sent."""
        return cached if self.enable_cache_report else 0

    def close(self) -> None:
        self.inputs.close()

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
ADMIN_CALLER = "pdserve.admin_caller"  # set on a request that presented the admin key (app.check_api_key)


def sees_other_clients(request: web.Request) -> bool:
    """Whether the caller may see other clients' requests (their ids, timings, token counts): where the gateway
    tells keys apart (an API key and an admin key both set), only the admin key's holder; elsewhere, whoever
    passed the key check."""
    gw = request.app[GATEWAY]
    return not (gw.api_key and gw.admin_api_key) or request.get(ADMIN_CALLER, False)


def new_id() -> str:
    return uuid.uuid4().hex


async def json_answer(request: web.Request, entries: int, build: Callable[[], object]) -> web.Response:
    """The JSON answer `build()` makes. `entries`: about how many token texts and logprobs it holds. From
    OFFLOAD_CHARS of them on, it is built and encoded (json_codec.encode) on the gateway's CPU pool: the top-20
    logprobs of an 8k-token echo are ~170k token texts and 4 MiB of JSON, a second of the event loop, and of every
    stream it serves, if done here. A smaller answer is built here and written by json.dumps, as any other."""
    if entries < OFFLOAD_CHARS:
        return web.json_response(build())
    body = await request.app[GATEWAY].cpu.run(entries, lambda: encode(build()))
    return web.Response(body=body, content_type="application/json", charset="utf-8")


class SSE:
    """A Server-Sent Events response: `data: <json>` events, then `data: [DONE]`.

    Headers go out with the first event, so a request that fails before producing anything (no worker,
    worker refused it) still gets a plain HTTP error status. A client that stops reading is cut off once a
    write has waited --stream-write-timeout for it: the handler ends as if the client had left (its generation
    is aborted and its admission places freed), where before it held them as long as the connection lived.
    """

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def send(self, obj: dict, entries: int = 0) -> None:
        """One event; `entries` as json_answer's: a large event (an echoed prompt's logprobs) is encoded on the
        gateway's CPU pool."""
        if not self.response.prepared:
            await self.response.prepare(self.request)
        if entries < OFFLOAD_CHARS:
            data = json.dumps(obj, ensure_ascii=False).encode()
        else:
            data = await self.request.app[GATEWAY].cpu.run(entries, encode, obj)
        await self._write(b"data: " + data + b"\n\n")

    async def _write(self, data: bytes) -> None:
        await self._bounded(self.response.write(data))

    async def _end(self) -> None:
        """The end of the stream, which waits until the client has taken what is left: bounded the same way."""
        await self._bounded(self.response.write_eof())

    async def _bounded(self, write) -> None:
        timeout_s = self.request.app[GATEWAY].limits.stream_write_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await write
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()  # what it has not read is dropped; the connection closes now
            raise ConnectionResetError(f"the client read nothing for {timeout_s:g} s") from None

    async def fail(self, exc: ApiError) -> web.StreamResponse:
        """End the stream with an error event; before anything was sent, answer with the error status instead."""
        if not self.started:
            raise exc
        await self.send({"error": exc.body()})
        return await self.done()

    async def done(self) -> web.StreamResponse:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self._write(b"data: [DONE]\n\n")
        await self._end()
        return self.response
