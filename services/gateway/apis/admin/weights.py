"""SGLang's POST /update_weights_from_disk: new weights on every worker of the deployment, or on none.

Body (SGLang's): `model_path` (required), `load_format` (auto, safetensors or gguf), `abort_all_requests`, and
`weight_version` (the label /get_model_info reports from then on). SGLang's other fields are accepted and
ignored; the prefix caches are always flushed, as their KV belongs to the old weights. Answer: `success`,
`message` with SGLang's texts, `num_paused_requests` (always 0: requests finish or are aborted, never paused);
status 200, or 400 when nothing changed.

One update, while new requests for the workers wait at the backend's door (`UpdateGate`, SGLang's model-update
lock; every request for the workers passes that door, whichever API or background task sends it):
1. prepare: every worker reads and checks the checkpoint and builds its weights beside the running ones, while
   serving. A refusal anywhere discards them everywhere: nothing changed, the old weights keep serving.
2. drain: the gate closes; requests in flight finish on the old weights or, with abort_all_requests, are
   aborted by the workers with a reason.
3. commit: every worker swaps the new weights in, flushes its prefix cache and takes the new version number. A
   prefill worker refuses KV for a decode worker of another version, so no request is prefilled with one
   version and decoded with another. Only a worker failing here leaves the deployment half-switched: the
   switched ones are put back on the weights they had.
4. /get_model_info reports the new path; the gate opens.

With several gateway processes (--gateway-workers), the one that takes the update holds them all
(siblings.py): one update at a time over the processes, every process's requests wait at its door and are
counted in the drain, and when the door opens each takes the new version, label and path and forgets its
prefix tables, as the updating process does.

The deployment's weights outlive its processes. A worker that (re)joins on older weights than the last commit
(it restarted, and came back on its start-up checkpoint) is kept out of rotation while it is brought up to date
(prepare and commit on it alone); a gateway that (re)starts takes the newest weights its workers report as the
deployment's (with their weight_version label, which every commit hands the workers), and brings the others to
them the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web
from pydantic import Field

from pdserve.services.gateway.apis.context import GATEWAY, WEIGHT_VERSION, Gateway
from pdserve.services.gateway.errors import read_json
from pdserve.services.gateway.intake.protocol import RequestModel, parse
from pdserve.services.gateway.siblings import SIBLINGS, LockTimeout, Siblings
from pdserve.services.gateway.workers.admin import (WEIGHTS_COMMIT, WEIGHTS_DISCARD, WEIGHTS_PREPARE, Outcome,
                                                    weights_step)
from pdserve.services.gateway.workers.backend import Door
from pdserve.services.gateway.workers.pool import Worker

log = logging.getLogger("pdserve.gateway")

LOAD_FORMATS = (None, "auto", "safetensors", "gguf")
PREPARE_TIMEOUT_S = 900.0  # a worker reads the checkpoint, then builds the weights (its own limit: 600 s)
COMMIT_TIMEOUT_S = 120.0  # a worker waits up to 60 s for its requests, then swaps
DRAIN_TIMEOUT_S = 600.0  # for the requests in flight to finish on the old weights
SMALL_TIMEOUT_S = 30.0  # discarding prepared weights; a call to the other gateway processes
# A process held by another one's update opens its door by itself after this long: the holder cannot be that
# slow (drain, commit, roll back), so it is gone without telling.
HOLD_LIMIT_S = DRAIN_TIMEOUT_S + COMMIT_TIMEOUT_S + PREPARE_TIMEOUT_S


# What a call to another gateway process raises when it does not answer in time.
SIBLING_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


class SiblingSilent(Exception):
    """Another process of the gateway did not answer before the commit: the update changes nothing."""


class UpdateWeightsRequest(RequestModel):
    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = Field(default=None, max_length=200)


class UpdateGate:
    """One update at a time (`updating`), over all the gateway's processes when it has `siblings`; it closes the
    backend's door (newcomers wait), waits until no request runs on the workers, swaps, and opens it again."""

    def __init__(self, door: Door, siblings: Siblings | None = None) -> None:
        self.door = door
        self._lock = asyncio.Lock()
        self.siblings = siblings
        self.weight_version = "default"  # SGLang's label of the weights served, for /get_model_info
        self.committed: tuple[int, str] | None = None  # (number, path) every worker must serve; None: as started
        self._reopen: asyncio.TimerHandle | None = None  # held by another process's update: the safety net

    @property
    def in_flight(self) -> int:
        return self.door.in_flight

    @contextlib.asynccontextmanager
    async def updating(self):
        """Held by one update (or catch-up) at a time, in this process and over its siblings."""
        async with self._lock, contextlib.AsyncExitStack() as stack:
            if self.siblings is not None:
                await stack.enter_async_context(self.siblings.exclusive("weights", HOLD_LIMIT_S))
            yield

    @contextlib.asynccontextmanager
    async def closed(self):
        self.door.close()
        try:
            yield
        finally:
            self.door.open()

    def hold(self) -> None:
        """Close the door for another process's update, until `release` (or HOLD_LIMIT_S)."""
        if self._reopen is not None:
            self._reopen.cancel()
        self.door.close()
        self._reopen = asyncio.get_running_loop().call_later(HOLD_LIMIT_S, self.release)

    def release(self) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
        self.door.open()

    async def drained(self, timeout: float) -> bool:
        return await self.door.drained(timeout)


GATE: web.AppKey[UpdateGate] = web.AppKey("update_gate", UpdateGate)


# ---------------------------------------------------------------- the endpoint
async def update_weights_from_disk(request: web.Request) -> web.Response:
    gw, gate = request.app[GATEWAY], request.app[GATE]
    req = parse(UpdateWeightsRequest, await read_json(request))
    if req.load_format not in LOAD_FORMATS:
        return _answer(False, f"Failed to get model loader: load_format {req.load_format!r} is not supported "
                              "(supported: auto, safetensors, gguf).")
    try:
        async with gate.updating():
            workers = gw.backend.serving_workers()
            down = [w.address for w in workers if not w.healthy or w.info is None]
            if not workers or down:
                return _answer(False, f"Failed to update weights: workers {', '.join(down) or '(none)'} are not "
                                      "serving; the weights change on every worker at once, so try again when all "
                                      "are healthy.", status=503)
            return await _update(gw, gate, workers, req)
    except LockTimeout as exc:
        return _answer(False, f"Failed to update weights: {exc} (an update that hangs); try again later.",
                       status=503)


async def _update(gw: Gateway, gate: UpdateGate, workers: list[Worker], req: UpdateWeightsRequest) -> web.Response:
    failed = _first_failure(await weights_step(workers, WEIGHTS_PREPARE, req.model_path, timeout=PREPARE_TIMEOUT_S))
    if failed is not None:
        await weights_step(workers, WEIGHTS_DISCARD, req.model_path, timeout=SMALL_TIMEOUT_S)
        if failed.path_not_found:
            return _answer(False, f"Failed to get weights iterator: {_sentence(failed.error)}")
        return _refused(failed.error)
    # The prepare replies told what each worker serves now: the next number is new to all of them.
    before = {w.address: (w.info.weights.number, w.info.weights.path, w.info.weights.tag) for w in workers}
    number = 1 + max(n for n, _, _ in before.values())
    tag = gate.weight_version if req.weight_version is None else req.weight_version
    try:
        async with gate.closed(), _held_everywhere(gw, gate):
            running = 0 if req.abort_all_requests else await _running_after(gate, DRAIN_TIMEOUT_S)
            if running:
                await weights_step(workers, WEIGHTS_DISCARD, req.model_path, timeout=SMALL_TIMEOUT_S)
                return _refused(f"{running} requests were still running after {DRAIN_TIMEOUT_S:g} s (retry, "
                                "or pass abort_all_requests)")
            return await _commit(gw, gate, workers, req, before, number, tag)
    except SiblingSilent as exc:  # before any commit: nothing changed anywhere
        await weights_step(workers, WEIGHTS_DISCARD, req.model_path, timeout=SMALL_TIMEOUT_S)
        return _refused(str(exc))


async def _commit(gw: Gateway, gate: UpdateGate, workers: list[Worker], req: UpdateWeightsRequest, before: dict,
                  number: int, tag: str) -> web.Response:
    """Swap the prepared weights in on every worker (the door closed, nothing running), or on none."""
    outcomes = await weights_step(workers, WEIGHTS_COMMIT, req.model_path, timeout=COMMIT_TIMEOUT_S,
                           abort_all_requests=req.abort_all_requests, version=number, tag=tag)
    failed = _first_failure(outcomes)
    if failed is not None:
        await _roll_back([o.worker for o in outcomes if o.ok], before)
        await weights_step(workers, WEIGHTS_DISCARD, req.model_path, timeout=SMALL_TIMEOUT_S)
        return _refused(failed.error)
    for worker in workers:
        gw.backend.router.forget(worker.address)  # the prefixes it held were flushed
    gate.committed = (number, req.model_path)
    _serve_path(gw, req.model_path)
    message = "Succeeded to update model weights."
    if req.weight_version is not None:
        gate.weight_version = req.weight_version
        message += f" Weight version updated to {req.weight_version}."
    log.info("weights updated to version %d from %s", number, req.model_path)
    return _answer(True, message)


def _serve_path(gw: Gateway, path: str) -> None:
    """/get_model_info and /get_server_info name the checkpoint now served."""
    gw.model_path = path
    if "model_path" in gw.server_args:
        gw.server_args["model_path"] = path


# ---------------------------------------------------------------- the other gateway processes
@contextlib.asynccontextmanager
async def _held_everywhere(gw: Gateway, gate: UpdateGate):
    """The other processes' doors closed too; on the way out, each takes what this one knows of the weights."""
    if gate.siblings is None:
        yield
        return
    try:
        try:  # inside: those that were held are released even when another did not answer
            await gate.siblings.tell("weights_hold", {}, SMALL_TIMEOUT_S)
        except SIBLING_ERRORS as exc:
            raise SiblingSilent(f"another process of this gateway did not answer ({exc or type(exc).__name__})")
        yield
    finally:
        state = {"committed": gate.committed, "weight_version": gate.weight_version, "model_path": gw.model_path}
        try:
            await asyncio.shield(gate.siblings.tell("weights_release", state, SMALL_TIMEOUT_S))
        except SIBLING_ERRORS as exc:  # one that missed it opens its door by itself after HOLD_LIMIT_S
            log.warning("a gateway process did not take the end of the weight update: %s", exc)


async def _running_after(gate: UpdateGate, timeout_s: float) -> int:
    """Requests for the workers still running, over every process, after waiting up to `timeout_s` for them."""
    async def here() -> int:
        await gate.drained(timeout_s)
        return gate.in_flight

    if gate.siblings is None:
        return await here()
    try:
        mine, theirs = await asyncio.gather(here(), gate.siblings.tell("weights_drained", {"timeout_s": timeout_s},
                                                                      timeout_s + SMALL_TIMEOUT_S))
    except SIBLING_ERRORS as exc:
        raise SiblingSilent(f"another process of this gateway did not answer ({exc or type(exc).__name__})")
    return mine + sum(answer["in_flight"] for answer in theirs)


class CatchUp:
    """The pool's admission check: lets in a worker on the deployment's weights, and brings one on older weights
    up to date first (retried every RETRY_S while it fails)."""

    RETRY_S = 30.0

    def __init__(self, gw: Gateway, gate: UpdateGate) -> None:
        self.gw, self.gate = gw, gate
        self.tasks: dict[str, asyncio.Task] = {}
        self.next_try: dict[str, float] = {}

    def __call__(self, worker: Worker) -> str | None:
        number, path = worker.info.weights.number, worker.info.weights.path
        committed = self.gate.committed
        if committed is None or number > committed[0]:
            if number > 0:  # weights an update of an earlier gateway committed: the deployment's
                self._adopt(number, path, worker.info.weights.tag)
            return None
        if number == committed[0]:
            return None
        loop = asyncio.get_running_loop()
        running = self.tasks.get(worker.address)
        if (running is None or running.done()) and loop.time() >= self.next_try.get(worker.address, 0.0):
            self.tasks[worker.address] = loop.create_task(self._bring_up(worker, *committed))
        return f"loading weights version {committed[0]} ({committed[1]}): it serves version {number} ({path})"

    def _adopt(self, number: int, path: str, tag: str) -> None:
        self.gate.committed = (number, path)
        self.gate.weight_version = tag or self.gate.weight_version
        _serve_path(self.gw, path)
        log.info("the workers serve weights version %d from %s", number, path)
        for worker in self.gw.backend.workers():  # admitted before: they rejoin through the check
            if worker.healthy and worker.info is not None and worker.info.weights.number < number:
                self.gw.backend.take_out(worker, f"serves weights version {worker.info.weights.number}, "
                                                 f"older than version {number}")

    async def _bring_up(self, worker: Worker, number: int, path: str) -> None:
        async with self.gate.updating():  # never beside an update
            if self.gate.committed != (number, path) or worker.info.weights.number >= number:
                return  # superseded meanwhile: the next check decides again
            log.info("%s worker %s serves weights version %d: loading version %d from %s", worker.role,
                     worker.address, worker.info.weights.number, number, path)
            (ready,) = await weights_step([worker], WEIGHTS_PREPARE, path, timeout=PREPARE_TIMEOUT_S)
            if ready.ok:
                (done,) = await weights_step([worker], WEIGHTS_COMMIT, path, timeout=COMMIT_TIMEOUT_S, version=number,
                                      tag=self.gate.weight_version)
                if done.ok:
                    self.gw.backend.router.forget(worker.address)
                    log.info("%s worker %s is on weights version %d", worker.role, worker.address, number)
                    return
                ready = done
            await weights_step([worker], WEIGHTS_DISCARD, path, timeout=SMALL_TIMEOUT_S)
            self.next_try[worker.address] = asyncio.get_running_loop().time() + self.RETRY_S
            log.error("%s worker %s could not load weights version %d (kept out of rotation, next try in %g s): "
                      "%s", worker.role, worker.address, number, self.RETRY_S, ready.error)


async def _roll_back(switched: list[Worker], before: dict[str, tuple[int, str, str]]) -> None:
    """Put `switched` workers back on the weights they served before (read again from their checkpoints)."""
    async def back(worker: Worker) -> None:
        number, path, tag = before[worker.address]
        (outcome,) = await weights_step([worker], WEIGHTS_COMMIT, path, timeout=PREPARE_TIMEOUT_S, version=number,
                                 tag=tag)
        if not outcome.ok:  # its version differs from its peers', which refuse its requests with a clear error
            log.error("%s worker %s could not go back to %s: %s", worker.role, worker.address, path, outcome.error)
    await asyncio.gather(*(back(w) for w in switched))


def _first_failure(outcomes: list[Outcome]) -> Outcome | None:
    return next((o for o in outcomes if not o.ok), None)


def _sentence(text: str) -> str:
    return text.rstrip(".") + "."


def _refused(error: str) -> web.Response:
    return _answer(False, f"Failed to update weights: {_sentence(error)}\nRolling back to original weights.")


def _answer(success: bool, message: str, status: int | None = None) -> web.Response:
    return web.json_response({"success": success, "message": message, "num_paused_requests": 0},
                             status=status or (200 if success else 400))


def _answer_siblings(gw: Gateway, gate: UpdateGate, siblings: Siblings) -> None:
    """Another process's update: hold this one's requests, say when they are done, take the new weights."""
    async def hold(body: dict) -> dict:
        log.info("another process of the gateway updates the weights: requests for the workers wait")
        gate.hold()
        return {}

    async def drained(body: dict) -> dict:
        await gate.drained(body["timeout_s"])
        return {"in_flight": gate.in_flight}

    async def release(body: dict) -> dict:
        committed = tuple(body["committed"]) if body["committed"] else None
        if committed != gate.committed:
            for worker in gw.backend.workers():
                gw.backend.router.forget(worker.address)  # the prefixes they held were flushed
        gate.committed, gate.weight_version = committed, body["weight_version"]
        _serve_path(gw, body["model_path"])
        gate.release()
        return {}

    siblings.handle("weights_hold", hold)
    siblings.handle("weights_drained", drained)
    siblings.handle("weights_release", release)


def add_routes(app: web.Application) -> None:
    gate = app[GATE] = UpdateGate(app[GATEWAY].backend.door, app.get(SIBLINGS))
    app[WEIGHT_VERSION] = lambda: gate.weight_version
    app[GATEWAY].backend.admit_workers_with(CatchUp(app[GATEWAY], gate))
    if gate.siblings is not None:
        _answer_siblings(app[GATEWAY], gate, gate.siblings)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
