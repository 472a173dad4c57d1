"""One generation: a tokenized prompt sent to a worker pair, its output handed out as per-choice updates.

Lifecycle: route -> Generate stream -> for each token of each choice: detokenize, match stop strings ->
`Update`s -> every choice finished. The gRPC call is cancelled, which aborts the request on the worker,
when every choice has ended on the gateway's side (a stop string), when the consumer stops reading (the
client went away), or when a worker of the pair is taken out (the prefill worker only until the first
output: after that the decode worker needs it no more).

When a worker of the pair turns out to be down, the generation goes on elsewhere: a failure before any
output is retried from scratch on another pair; one after output migrates (migration.py: another pair
continues each running choice from its output so far), or, for what cannot migrate, starts over when
nothing reached the client yet. Otherwise, or once the attempts are used up, or when no healthy pair is
left, the generation ends with a 503. A decode worker may also hand a running generation over live
(live_move.py: drain, rebalance): the next attempt takes its KV from there, and recomputes only should that fail.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import params_to_proto
from pdserve.services.gateway.errors import ApiError, Busy
from pdserve.services.gateway.metrics import GatewayMetrics, TokenTimer
from pdserve.services.gateway.tokenization import Detokenizer, ModelTokenizer
from pdserve.services.gateway.workers.job import ChoiceResult, Job, TokenLogprob, Update
from pdserve.services.gateway.workers.live_move import LiveMove, Mover, aim, live_move
from pdserve.services.gateway.workers.migration import continuation, why_not_movable
from pdserve.services.gateway.workers.pool import Worker
from pdserve.services.gateway.workers.record import GenerationRecord, names
from pdserve.services.gateway.workers.router import Pair
from pdserve.services.gateway.workers.stops import StopMatcher

log = logging.getLogger("pdserve.gateway")


@dataclass(frozen=True)
class GenerationSettings:
    retry_after_s: int = 2  # what a refused client is told to wait (Retry-After)
    first_output_timeout_s: float = 300.0  # queueing + prefill on the workers
    stall_timeout_s: float = 150.0  # between two outputs (the workers give up after 120 s themselves)
    max_attempts: int = 3  # pairs tried for one generation before its first output (retries, restarts)
    max_migrations: int = 3  # moves of one generation to another pair mid-stream (migration.py)


class Pairs(Protocol):
    """Where a generation's attempts run (the gateway's Backend): a pair for a prompt, and, after a failure,
    which workers of the pair are down."""
    mover: Mover  # where a live move goes (live_move.py)

    def route(self, input_ids: list[int], exclude: frozenset[str] = frozenset(),
              cache_salt: str | None = None) -> Pair: ...

    async def probe_pair(self, pair: Pair) -> set[str]: ...


def refusal(exc: grpc.aio.AioRpcError, retry_after_s: float) -> ApiError | None:
    """The client's error when a worker refused the request itself (a bad input: 400; full: 429), which another
    worker would refuse too; None for a failure of the worker, which another attempt may get past."""
    code, details = exc.code(), exc.details() or exc.code().name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Busy(429, f"The server is busy: {details}", retry_after_s)
    return None


class WorkerFailure(Exception):
    """The pair failed this attempt (worker down, stream broken, no progress)."""


class Restart:
    """Handed out by `Generation.run(restartable=True)` before it starts over: forget what came before."""


@dataclass
class _Tries:
    """What the failed attempts of one generation have used up so far."""

    down: set[str] = field(default_factory=set)  # addresses of workers found down: not tried again
    fresh: int = 0  # retries and restarts: with the first attempt, at most max_attempts from scratch
    migrations: int = 0  # moves to another pair mid-stream (at most max_migrations)
    failure: str = ""  # why the last attempt failed
    move: LiveMove | None = None  # the live move the last attempt ended with, or continued (then it failed)


class _Choice:
    def __init__(self, gen: Generation) -> None:
        job = gen.job
        self.detok = Detokenizer(gen.tokenizer, job.skip_special_tokens, job.spaces_between_special_tokens)
        self.stops = StopMatcher(job.stops, keep_stop=job.no_stop_trim, regexes=job.stop_regex)
        self.finished = False
        self.finish_reason: str | None = None
        # Every token the workers produced, up to the one that ended the choice; a migration resends them.
        self.output_ids: list[int] = []

    @property
    def tokens(self) -> int:
        """Completion tokens, counted up to the one that ended the choice."""
        return len(self.output_ids)


class Generation:
    def __init__(self, job: Job, pairs: Pairs, tokenizer: ModelTokenizer, metrics: GatewayMetrics,
                 settings: GenerationSettings) -> None:
        self.job = job
        self.pairs = pairs
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.settings = settings
        self.start = time.perf_counter()
        self.prompt_tokens = len(job.input_ids)
        self.cached_tokens = 0
        self.cached_by_tier = {"host": 0, "storage": 0}  # of those, put back from a lower tier for it
        self.input_logprobs: list[TokenLogprob] = []  # prompt tokens from max(logprob_start_len, 1) on
        # max_new_tokens 0: (token id, logprob) of the job's token_ids_logprob at the position after the prompt
        self.next_ids_logprobs: list[tuple[int, float]] = []
        self.choices: list[_Choice] = []
        self.pair: Pair | None = None
        # The id the workers know the current attempt by: the job's, then "{rid}.{n}" for the n-th attempt after
        # a failure, so that what the workers still hold of an earlier attempt (an abort sent to a prefill worker
        # before the request reached it, remembered to refuse it when it does) never meets the new one.
        self.worker_rid = job.rid
        self.record = GenerationRecord(job, metrics)  # its spans, TTFT parts and timeline, for operators
        self._attempts = 0
        self._call = None
        self._failure: str | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def e2e_latency(self) -> float:
        return time.perf_counter() - self.start

    # ------------------------------------------------------------ consumers
    async def updates(self) -> AsyncIterator[Update]:
        """Streaming: updates as they come; retried only while nothing was handed out."""
        # Each layer closes the one below at once, so the gRPC call is cancelled as soon as the consumer stops.
        async with contextlib.aclosing(self.run(restartable=False)) as updates:
            async for u in updates:
                yield u

    async def collect(self) -> list[ChoiceResult]:
        """Not streaming: every choice complete (a failed attempt may be retried from scratch)."""
        results = [ChoiceResult(i) for i in range(self.job.params.n)]
        async with contextlib.aclosing(self.run(restartable=True)) as updates:
            async for u in updates:
                if isinstance(u, Restart):
                    results = [ChoiceResult(i) for i in range(self.job.params.n)]
                else:
                    results[u.index].add(u)
        return results

    async def run(self, restartable: bool) -> AsyncIterator[Update | Restart]:
        """Attempts on pairs until every choice has finished (see the module docstring for what follows a
        failure). `restartable`: the consumer can take a `Restart` (nothing has reached the client yet)."""
        tries = _Tries()
        timer = TokenTimer(self.metrics, self.start)
        self.choices = self._new_choices()
        while True:
            pair = self._route(tries)
            self.worker_rid = self.job.rid if not self._attempts else f"{self.job.rid}.{self._attempts}"
            self._attempts += 1
            move, tries.move = tries.move, None
            try:
                async with contextlib.aclosing(self._attempt(pair, timer, move)) as updates:
                    async for u in updates:
                        yield u
                return
            except LiveMove as exc:
                tries.failure, tries.move = str(exc), exc
                self._move_live(pair, tries)
            except WorkerFailure as exc:
                tries.failure, tries.move = str(exc), move  # a failed live move falls back to recomputing
                if await self._recover(pair, tries, restartable) == "restart":
                    yield Restart()

    @property
    def produced(self) -> bool:
        """Whether any choice has output yet: what decides between a retry and a migration."""
        return any(c.tokens for c in self.choices)

    def _new_choices(self) -> list[_Choice]:
        return [_Choice(self) for _ in range(self.job.params.n)]

    def _route(self, tries: _Tries) -> Pair:
        live = self.pairs.mover.exclude_for(tries.move) if tries.move is not None else frozenset()  # moving it
        try:
            return self.pairs.route(self._input_ids(), frozenset(tries.down) | live, self.job.params.cache_salt)
        except ApiError as exc:
            if not self.produced:
                raise
            raise ApiError(503, f"The request failed on the workers ({tries.failure}) after {self.completion_tokens} "
                                f"tokens and no other worker pair can continue it: {exc.message}") from None

    async def _recover(self, pair: Pair, tries: _Tries, restartable: bool) -> str:
        """After `pair` failed: "retry", "migrate" or "restart" (then the next attempt may start), or the 503."""
        down = await self.pairs.probe_pair(pair)
        step, why_not = self._next_step(bool(down), tries, restartable)
        reason, tries.move = tries.move.reason if tries.move is not None else "failure", None
        log.warning("request %s failed on %s after %d tokens: %s%s", self.job.rid, names(pair),
                    self.completion_tokens, tries.failure, f"; next: {step}" if step else "")
        self.record.failed(step or "failed", tries.failure, self.completion_tokens, names(pair))
        if step is None:
            raise ApiError(503, f"The request failed on the workers: {tries.failure}{why_not}")
        tries.down |= down
        if step == "migrate":
            tries.migrations += 1
            self.metrics.migrations.labels("recompute", reason).inc()
            return step
        tries.fresh += 1
        self.metrics.retries.inc()
        if step == "restart":
            self.choices = self._new_choices()
        return step

    def _next_step(self, worker_down: bool, tries: _Tries, restartable: bool) -> tuple[str | None, str]:
        """What may follow a failed attempt, and else why nothing may (a suffix for the error message).

        Only a worker found down makes another attempt worth it: a pair that is alive but failed or stalled
        would most likely fail the same way again."""
        settings = self.settings
        if not worker_down and tries.move is None:  # a failed live move recomputes, its workers alive or not
            return None, ""
        can_start_over = tries.fresh + 1 < settings.max_attempts
        if not self.produced:
            return ("retry", "") if can_start_over else (None, "")
        why_not = why_not_movable(self.job.params)
        if why_not is None:
            if tries.migrations < settings.max_migrations:
                return "migrate", ""
            why_not = f"it was already moved to another worker {tries.migrations} times"
        if restartable and can_start_over:
            return "restart", ""
        return None, f" ({why_not})"

    def _input_ids(self) -> list[int]:
        """What the next attempt computes first (its route's prefix affinity): the prompt, then the first choice's
        output so far when it continues one."""
        if not self.produced:
            return self.job.input_ids
        return self.job.input_ids + self.choices[0].output_ids

    def _request(self, pair: Pair) -> pb.GenerateRequest:
        job = self.job
        resume = continuation([None if c.finished else c.output_ids for c in self.choices]) if self.produced else []
        return pb.GenerateRequest(rid=self.worker_rid, input_ids=job.input_ids, sampling=params_to_proto(job.params),
                                  prefill_addr=pair.prefill.address if pair.prefill is not None else "",
                                  lora=job.lora or "", public_id=job.public_id, resume=resume)

    def _move_live(self, pair: Pair, tries: _Tries) -> None:
        """The generation froze on its decode worker to move: its next attempt continues it live, if it may."""
        may = self.produced and tries.migrations < self.settings.max_migrations
        self.record.failed("move" if may else "failed", tries.failure, self.completion_tokens, names(pair))
        if not may:
            raise ApiError(503, f"The request failed on the workers: {tries.failure} ({tries.migrations} moves)")
        tries.migrations += 1

    # ------------------------------------------------------------ one attempt on one pair
    async def _attempt(self, pair: Pair, timer: TokenTimer, move: LiveMove | None = None) -> AsyncIterator[Update]:
        resumed = self.produced
        self.pair, self._failure = pair, None
        request = self._request(pair)
        if move is not None:
            aim(request, move)
        self.record.attempt(pair, self._attempts, resumed, request)
        call = self._call = pair.generate.generations.start(request)
        held = list(pair.workers)
        for w in held:
            w.in_flight += 1
            w.on_out.add(self._fail)
        first = True
        try:
            while not all(c.finished for c in self.choices):
                msg = await self._read(call, first)
                if first:
                    first = False
                    if pair.prefill is not None:  # its part is done: its death no longer concerns this request
                        self._release(pair.prefill, held)
                    if move is not None:  # the move is complete
                        self.record.moved(move, pair.generate, msg.kv_moved_bytes)
                    if not resumed:  # usage and prompt logprobs describe the client's prompt
                        self._on_first(msg)
                        if self._attempts == 1:  # a retry's TTFT holds its failed attempts too
                            self.record.first_message(msg, self.start)
                for delta in msg.choices:
                    timer.tokens(len(delta.token_ids))
                    update = self._on_delta(delta)
                    if update is not None:
                        yield update
        finally:
            for w in list(held):
                self._release(w, held)
            if not call.done():
                call.cancel()  # aborts the request on the worker, freeing its pages
            self._call = None
            self.record.end_attempt(self, self._failure)

    async def _read(self, call, first: bool) -> pb.GenerateResponse:
        """The next message of the stream; a WorkerFailure when the pair fails, stalls or is taken out."""
        settings = self.settings
        try:
            async with asyncio.timeout(settings.first_output_timeout_s if first else settings.stall_timeout_s):
                msg = await call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._failure is not None and task is not None and not task.cancelling():
                raise WorkerFailure(self._failure) from None
            raise
        except TimeoutError:
            raise WorkerFailure("no output from the worker in time") from None
        except grpc.aio.AioRpcError as exc:
            raise self._map_rpc_error(exc) from None
        if msg is grpc.aio.EOF:
            raise WorkerFailure("the worker closed the stream before every choice finished")
        return msg

    def _release(self, worker: Worker, held: list[Worker]) -> None:
        held.remove(worker)
        worker.in_flight -= 1
        worker.on_out.discard(self._fail)

    def _on_first(self, msg: pb.GenerateResponse) -> None:
        job = self.job
        self.prompt_tokens, self.cached_tokens = msg.prompt_tokens or self.prompt_tokens, msg.cached_tokens
        self.cached_by_tier = {"host": msg.host_cached_tokens, "storage": msg.storage_cached_tokens}
        named = job.params.token_ids_logprob
        self.input_logprobs = [TokenLogprob(t, lp.logprob, list(zip(lp.top.token_ids, lp.top.logprobs)),
                                            list(zip(named, lp.ids.logprobs)))
                               for t, lp in zip(job.input_ids[max(job.params.logprob_start_len, 1):],
                                                msg.input_logprobs)]

    def _fail(self, reason: str) -> None:
        """A worker of the pair was taken out: end this attempt now."""
        self._failure = reason
        if self._call is not None:
            self._call.cancel()

    def _map_rpc_error(self, exc: grpc.aio.AioRpcError) -> Exception:
        refused = refusal(exc, self.settings.retry_after_s)
        if refused is not None:
            return refused
        move = live_move(exc, self.pair.generate, self.worker_rid) if self.pair is not None else None
        if move is not None:
            return move
        if exc.code() == grpc.StatusCode.CANCELLED and self._failure is not None:
            return WorkerFailure(self._failure)
        return WorkerFailure(exc.details() or exc.code().name)

    # ------------------------------------------------------------ output of one choice
    def _on_delta(self, delta: pb.ChoiceDelta) -> Update | None:
        if not 0 <= delta.index < len(self.choices):
            return None
        choice = self.choices[delta.index]
        if choice.finished:
            return None  # the gateway already ended this choice (stop string); the worker has not yet
        update = Update(delta.index)
        ids = list(delta.token_ids)
        stop_token = delta.matched_stop_token if delta.finish_reason == "stop" else -1
        if not ids and delta.token_ids_logprobs:  # logprobs without a token: max_new_tokens 0
            self.next_ids_logprobs = list(zip(self.job.params.token_ids_logprob, delta.token_ids_logprobs[0].logprobs))
        for i, token in enumerate(ids):
            choice.output_ids.append(token)
            update.token_ids.append(token)
            if i < len(delta.logprobs):
                top = delta.top_logprobs[i] if i < len(delta.top_logprobs) else None
                named = delta.token_ids_logprobs[i].logprobs if i < len(delta.token_ids_logprobs) else ()
                update.logprobs.append(TokenLogprob(token, delta.logprobs[i], list(zip(
                    top.token_ids, top.logprobs)) if top is not None else [],
                    list(zip(self.job.params.token_ids_logprob, named))))
            if i == len(ids) - 1 and token == stop_token and stop_token >= 0:
                break  # the stop token itself is never shown
            result = choice.stops.push(choice.detok.push([token]))
            update.text += result.text
            if result.matched is not None:
                choice.finished, choice.finish_reason = True, "stop"
                update.finish_reason, update.matched_stop = "stop", result.matched
                return update
        if delta.finish_reason:
            result = choice.stops.push(choice.detok.flush())
            update.text += result.text
            choice.finished = True
            if result.matched is not None:
                update.finish_reason, update.matched_stop = "stop", result.matched
            else:
                update.text += choice.stops.flush()
                update.finish_reason = delta.finish_reason
                update.matched_stop = stop_token if stop_token >= 0 else None
            choice.finish_reason = update.finish_reason
        if not update.token_ids and not update.text and update.finish_reason is None:
            return None
        return update
