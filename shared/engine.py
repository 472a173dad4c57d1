"""Engine: the runtime loop of one worker, in one thread that owns all runtime state.

    batch = scheduler.schedule(); logits = runner.forward(batch); self.postprocess(batch, logits)

Other threads never touch the scheduler, pool or cache: they hand the engine a
function with `call(fn)` and get a Future back. Results leave through each
request's `on_output` callback, called from the engine thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import torch

from pdserve.shared.config import Role, RuntimeConfig
from pdserve.shared.expert_recorder import ExpertRecorder, no_experts
from pdserve.shared.grammar import Constraint, Grammars, apply_masks
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.compute_thread import ComputeThread
from pdserve.shared.lora import LoraAdapter, LoraError
from pdserve.shared.lora_registry import LoraRegistry
from pdserve.shared.radix_cache import RadixCache
from pdserve.shared.req import Req, ReqOutput, ReqStatus, TokenLogprobs
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.sampler import Sampler, make_generator
from pdserve.shared.scheduler import Batch, PoolExhausted, Scheduler
from pdserve.shared.weights import Checkpoint, WeightsError, WeightsVersion

log = logging.getLogger(__name__)
T = TypeVar("T")
EARLY_ABORT_MEMORY_S = 60.0  # how long a prefill worker remembers an abort of a request it has not seen
EARLY_ABORT_MEMORY_MAX = 10_000


@dataclass
class FirstToken:
    """A token sampled by a prefill worker for one choice of a request."""

    token_id: int
    logprob: TokenLogprobs | None = None


@dataclass
class PrefillResult:
    first_tokens: list[FirstToken]
    cached_tokens: int
    queue_s: float
    compute_s: float
    transfer_s: float = 0.0
    input_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt logprobs, when asked for


@dataclass
class StepStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_step_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


# Prefill role: write the KV pages of a finished prompt to req.transfer; returns seconds taken, raises on failure.
TransferFn = Callable[[Req], float]


class RequestObserver:
    """Hooks at a request's lifecycle, for metrics; called on the engine thread, and doing nothing here.

    Each runs once per request, or once per output message of a request, never per batch: keep them cheap.
    """

    def scheduled(self, req: Req) -> None:
        """The first chunk of `req`'s prompt ran (at `req.first_scheduled`): its queue time is over."""

    def prefilled(self, req: Req) -> None:
        """The KV of `req`'s fresh prompt is complete (`req.cached_tokens` of it came from the prefix cache)."""

    def output(self, req: Req, num_tokens: int, finish_reason: str | None) -> None:
        """`num_tokens` new tokens of `req` (none when it only finishes) are leaving through `on_output`."""


class Engine:
    def __init__(self, config: RuntimeConfig, role: Role = Role.COLOCATED, runner: ModelRunner | None = None,
                 transfer_fn: TransferFn | None = None, poll_fn: Callable[[], None] | None = None,
                 observer: RequestObserver | None = None) -> None:
        self.config = config
        self.role = role
        self.runner = runner or ModelRunner(config)
        self.model_config = self.runner.model_config
        # A pooling model (--is-embedding decoder, sequence classifier) has no LM head: nothing to sample.
        mc = self.model_config
        self.generates = not (config.is_embedding or mc.is_classifier or mc.is_bare)
        page_size = self.runner.page_size
        self.allocator = PageAllocator(self.runner.pool.num_pages)
        self.cache = RadixCache(page_size)
        lora = getattr(self.runner, "lora", None)  # runners built for a test may have no adapters at all
        self.scheduler = Scheduler(config.scheduler, role, self.allocator, self.cache, page_size,
                                   lora.pool if lora is not None else None)
        self.sampler = Sampler()
        self.transfer_fn = transfer_fn
        self.poll_fn = poll_fn
        self.observer = observer or RequestObserver()
        self.stats = StepStats()
        self._inbox: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | ComputeThread | None = None
        self._stopping = False
        # Prefill role: rid -> (future of the PrefillResult, arrival time).
        self._prefill_waiters: dict[str, tuple[Future, float]] = {}
        self._early_aborts: dict[str, float] = {}  # prefill role: rid -> when its abort came before it
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._experts: ExpertRecorder | None = None  # made at the first recording command
        self.weights = WeightsVersion(0, config.model_path)  # what the runner serves (see commit_weights)
        self._staged: tuple[str, object] | None = None  # (path, model) of weights built but not yet served

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of params' constraint, or None. Any thread; raises GrammarError.

        Workers call it before `add_request`, off the engine thread, so compiling never delays a step.
        """
        if params.constraint is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
                self._grammars = Grammars(tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        return self._grammars.compile(params)

    # ------------------------------------------------------------ thread API
    def start(self, thread: ComputeThread | None = None) -> None:
        """Run the step loop on `thread` (the one that loaded the model: see compute_thread.py), or a new one."""
        if thread is not None:
            self._thread = thread
            thread.hand_over(self.run_forever)
            return
        self._thread = threading.Thread(target=self.run_forever, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self.call(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[[], T]) -> Future:
        """Run `fn` in the engine thread between steps; its result (or exception) lands in the Future."""
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut

    def run_forever(self) -> None:
        while not self._stopping:
            idle = not self.has_work()
            self._drain_inbox(block=idle)
            if self.poll_fn is not None:
                self.poll_fn()
            if self.has_work():
                try:
                    self.step()
                except Exception as exc:  # a failed step must not leave requests hanging
                    log.exception("engine step failed")
                    self._fail_all(f"internal error: {exc}")

    def _drain_inbox(self, block: bool) -> None:
        timeout = 0.002 if self.scheduler.awaiting_kv else 0.05
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller through the future
                    fut.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or s.chunked or s.reserving)

    # ------------------------------------------------------------ requests (engine thread)
    def add_request(self, req: Req, lora: str | None = None, lora_version: str | None = None) -> None:
        """Queue `req`; `lora` names its adapter (or the path it was loaded from), `lora_version` the version
        the peer worker of a PD pair runs. Raises ValueError for anything the request cannot run with."""
        req.params.validate(self.model_config.vocab_size)
        if lora:
            req.lora = self._lora(lora).resolve(lora, lora_version)
        limit = self.runner.context_length
        if len(req.input_ids) == 0:
            raise ValueError("the prompt is empty")
        if len(req.input_ids) >= limit:
            raise ValueError(f"the prompt has {len(req.input_ids)} tokens, which is not shorter than the "
                             f"context length of {limit} tokens")
        req.generator = make_generator(req.params.seed)
        if req.params.constraint is not None and req.grammar is None:  # callers that did not compile ahead
            req.grammar = Constraint.for_params(self.compile_grammar(req.params), req.params)
        if req.params.max_new_tokens == 0 and self.role != Role.PREFILL:
            self._emit(req, finish_reason="length")
            req.status = ReqStatus.FINISHED
            return
        self.scheduler.add(req)
        if self.role == Role.DECODE:
            self._reserve()

    def add_prefill(self, req: Req, lora: str | None = None, lora_version: str | None = None) -> Future:
        """Prefill role: queue `req` (with req.transfer set); the Future yields its PrefillResult."""
        if self._early_aborts.pop(req.rid, None) is not None:
            raise RuntimeError(f"request {req.rid} was aborted before it arrived")
        fut: Future = Future()
        self._prefill_waiters[req.rid] = (fut, time.monotonic())
        try:
            self.add_request(req, lora, lora_version)
        except Exception:
            self._prefill_waiters.pop(req.rid, None)
            raise
        return fut

    def abort(self, rid: str, reason: str = "abort", error: str | None = None) -> bool:
        reqs = self.scheduler.find(rid)
        for req in reqs:
            self.scheduler.remove(req, cache=req.status >= ReqStatus.RUNNING)
            self._emit(req, finish_reason=reason, error=error)
        waiter = self._prefill_waiters.pop(rid, None)
        if waiter is not None and not waiter[0].done():
            waiter[0].set_exception(RuntimeError(error or "aborted"))
        if not reqs and waiter is None and self.role == Role.PREFILL:
            self._remember_abort(rid)
        return bool(reqs)

    def _remember_abort(self, rid: str) -> None:
        """Prefill role: an abort can overtake its request (two calls from the decode side); the request is
        then refused when it arrives instead of being computed for nobody."""
        now = time.monotonic()
        self._early_aborts[rid] = now
        while self._early_aborts:
            oldest, at = next(iter(self._early_aborts.items()))
            if now - at < EARLY_ABORT_MEMORY_S and len(self._early_aborts) <= EARLY_ABORT_MEMORY_MAX:
                break
            del self._early_aborts[oldest]

    def _fail_all(self, error: str) -> None:
        for req in self.scheduler.live_reqs():
            self.abort(req.rid, error=error)

    # ------------------------------------------------------------ decode role
    def _reserve(self) -> None:
        for req in self.scheduler.reserve_pages():
            if req.on_pages_reserved is not None:
                req.on_pages_reserved(req)

    def kv_ready(self, rid: str, first_tokens: list[FirstToken], cached_tokens: int) -> None:
        """Decode role: prefill filled the reserved pages of `rid`; start decoding it."""
        group = self.scheduler.awaiting_kv.pop(rid, None)
        if not group:
            return  # aborted meanwhile
        req = group[0]
        req.num_computed = len(req.input_ids)
        req.cached_tokens = cached_tokens
        self.scheduler.cache_pages(req, lock=True)
        children = [req] + self._fork(req)
        for child, first in zip(children, first_tokens):
            child.status = ReqStatus.RUNNING
            self.scheduler.running.append(child)
            self._append_token(child, first.token_id, first.logprob)
        self._emit_all(children)

    def kv_settled(self, rid: str) -> None:
        """Decode role: no KV write into `rid`'s reserved pages can land any more (the prefill call ended);
        the pages of an `rid` aborted while it waited for them go back to the pool now."""
        self.scheduler.release_quarantine(rid)

    # ------------------------------------------------------------ the step
    def step(self) -> None:
        if self.role == Role.DECODE:
            self._reserve()
        try:
            batch = self.scheduler.schedule()
        except PoolExhausted as exc:
            for req in list(self.scheduler.running):
                self.abort(req.rid, error=str(exc))
            return
        if batch is None:
            return
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        self.stats.last_step_s = time.perf_counter() - t0
        self.stats.steps += 1
        self.postprocess(batch, logits, self.stats.last_step_s)

    def postprocess(self, batch: Batch, logits: torch.Tensor, compute_s: float) -> None:
        if batch.prompt_rows:
            self._prompt_logprobs(batch)
        rows: list[int] = []
        reqs: list[Req] = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            req.num_computed += n
            if batch.is_decode or req.status == ReqStatus.RUNNING:  # a decode, alone or beside prefills
                self.stats.decode_tokens += 1
                rows.append(i)
                reqs.append(req)
                continue
            self.stats.prefill_tokens += n
            if req.first_scheduled is None:  # its first chunk: it left the queue when this step began
                req.first_scheduled = time.monotonic() - compute_s
                self.observer.scheduled(req)
            if req.num_computed < req.seq_len:
                req.status = ReqStatus.PREFILLING
                self.scheduler.chunked = req
                continue
            if self.scheduler.chunked is req:
                self.scheduler.chunked = None
            self.scheduler.cache_pages(req, lock=True)
            if not req.output_ids:  # a fresh prompt, not the recompute of a retracted request
                self.observer.prefilled(req)
            # A fresh prompt with n > 1 becomes n choices sharing the prompt's pages; a prefill
            # worker only samples each choice's first token, the decode worker forks the pages.
            if req.output_ids:
                family = [req]
            elif self.role == Role.PREFILL:
                family = [req] + [self._sibling(req, index) for index in range(1, req.params.n)]
            else:
                family = [req] + self._fork(req)
            for member in family:
                rows.append(i)
                reqs.append(member)
        if not reqs:
            return
        tokens, logprobs = self._sample(logits, rows, reqs)
        if self.role == Role.PREFILL:
            self._finish_prefills(reqs, tokens, logprobs, compute_s)
            return
        for req, tok, lp in zip(reqs, tokens, logprobs):
            if req.status != ReqStatus.RUNNING:
                req.status = ReqStatus.RUNNING
                self.scheduler.running.append(req)
            self._append_token(req, tok, lp)
        self._emit_all(reqs)

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]):
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        if any(r.grammar is not None for r in reqs):
            apply_masks(logits, [r.grammar for r in reqs])
        out = self.sampler.sample(logits, [r.params for r in reqs], [r.input_ids for r in reqs],
                                  [r.output_ids for r in reqs], [r.generator for r in reqs],
                                  self.model_config.eos_token_ids)
        tokens = out.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        if out.logprobs is not None:
            lps = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for i, req in enumerate(reqs):
                if req.params.return_logprob or req.params.top_logprobs_num:
                    k = req.params.top_logprobs_num
                    logprobs[i] = TokenLogprobs(lps[i], top_ids[i][:k] if top_ids and k else [],
                                                top_lps[i][:k] if top_lps and k else [])
        return tokens, logprobs

    def _prompt_logprobs(self, batch: Batch) -> None:
        """Append to each request the logprobs of the prompt tokens this chunk's logits predict."""
        logprobs = torch.log_softmax(batch.prompt_logits.float(), dim=-1)
        offset = 0
        for req, first, count in batch.prompt_rows:
            rows = logprobs[offset:offset + count]
            offset += count
            targets = torch.tensor(req.input_ids[first + 1:first + 1 + count], device=rows.device)
            chosen = rows.gather(1, targets[:, None])[:, 0].tolist()
            k = req.params.top_logprobs_num
            top_lps, top_ids = rows.topk(k, dim=-1) if k else (None, None)
            for i, lp in enumerate(chosen):
                req.input_logprobs.append(TokenLogprobs(lp, top_ids[i].tolist() if k else [],
                                                        top_lps[i].tolist() if k else []))
        batch.prompt_logits = None

    def _fork(self, req: Req) -> list[Req]:
        """Make the n-1 sibling choices of a request whose prompt KV is complete and cached."""
        children = []
        for index in range(1, req.params.n):
            seed = None if req.params.seed is None else req.params.seed + index
            child = Req(rid=req.rid, input_ids=req.input_ids, params=req.params, on_output=req.on_output,
                        index=index)
            child.generator = make_generator(seed)
            child.grammar = req.grammar.fork() if req.grammar is not None else None
            child.lora = req.lora
            self.scheduler.hold_adapter(child)  # one more use of the slot the parent holds
            child.cached_tokens = req.cached_tokens
            child.num_computed = req.num_computed
            child.prefix_node = req.prefix_node
            child.num_cached_pages = req.num_cached_pages
            self.cache.lock(req.prefix_node)
            child.pages = req.pages[:req.num_cached_pages]
            for page in req.pages[req.num_cached_pages:]:  # the partly filled last page is copied
                new = self.scheduler.allocate(1)
                if new is None:
                    self.scheduler.release(child, cache=False)
                    break
                self.runner.pool.copy_page(page, new[0])
                child.pages.append(new[0])
            else:
                children.append(child)
                continue
            self._emit(child, finish_reason="abort", error="out of KV pages for n > 1")
        return children

    def _append_token(self, req: Req, token: int, logprob: TokenLogprobs | None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.grammar is not None and not req.grammar.accept(token):
            # Only when the grammar left nothing to sample (e.g. it must end but min_new_tokens bans eos).
            req.finish_reason = "stop"
            self.scheduler.remove(req, cache=True)
            return
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        p = req.params
        if not p.ignore_eos and token in self.model_config.eos_token_ids:
            req.finish_reason, req.matched_stop_token = "stop", token
        elif token in p.stop_token_ids:
            req.finish_reason, req.matched_stop_token = "stop", token
        elif req.grammar is not None and req.grammar.terminated:  # complete, and its end accepted (ignore_eos)
            req.finish_reason, req.matched_stop_token = "stop", token
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.runner.context_length:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.scheduler.remove(req, cache=True)

    def _sibling(self, req: Req, index: int) -> Req:
        """A sampling-only stand-in for choice `index` of a prompt on a prefill worker."""
        seed = None if req.params.seed is None else req.params.seed + index
        sibling = Req(rid=req.rid, input_ids=req.input_ids, params=req.params, index=index)
        sibling.generator = make_generator(seed)
        sibling.grammar = req.grammar.fork() if req.grammar is not None else None
        return sibling

    def _finish_prefills(self, reqs: list[Req], tokens: list[int], logprobs: list, compute_s: float) -> None:
        firsts: dict[str, list[FirstToken]] = {}
        for req, tok, lp in zip(reqs, tokens, logprobs):
            firsts.setdefault(req.rid, []).append(FirstToken(tok, lp))
        for req in reqs:
            if req.index != 0:
                continue
            fut, arrival = self._prefill_waiters.pop(req.rid, (None, req.arrival))
            req.status = ReqStatus.TRANSFERRING
            try:
                transfer_s = self.transfer_fn(req) if self.transfer_fn is not None else 0.0
            except Exception as exc:
                log.warning("KV transfer of %s failed: %s", req.rid, exc)
                self.scheduler.remove(req, cache=True)
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                continue
            self.scheduler.remove(req, cache=True)
            result = PrefillResult(firsts[req.rid], req.cached_tokens,
                                   queue_s=max(0.0, time.monotonic() - arrival - compute_s - transfer_s),
                                   compute_s=compute_s, transfer_s=transfer_s, input_logprobs=req.input_logprobs)
            if fut is not None and not fut.done():
                fut.set_result(result)

    # ------------------------------------------------------------ outputs
    def _emit_all(self, reqs: list[Req]) -> None:
        for req in reqs:
            self._emit(req, finish_reason=req.finish_reason, matched=req.matched_stop_token)

    def _emit(self, req: Req, finish_reason: str | None = None, matched: int | None = None,
              error: str | None = None) -> None:
        if req.on_output is None:
            return
        new_ids = req.output_ids[req.num_sent:]
        new_lps = req.output_logprobs[req.num_sent:] if req.output_logprobs else []
        if not new_ids and finish_reason is None:
            return
        req.num_sent = len(req.output_ids)
        self.observer.output(req, len(new_ids), finish_reason)
        prompt_lps = None
        if req.input_logprobs and not req.input_logprobs_sent and req.index == 0:
            prompt_lps, req.input_logprobs_sent = req.input_logprobs, True
        req.on_output(ReqOutput(req.rid, req.index, new_ids, new_lps, finish_reason, matched,
                                prompt_tokens=len(req.input_ids), cached_tokens=req.cached_tokens, error=error,
                                input_logprobs=prompt_lps))

    # ------------------------------------------------------------ inspection (engine thread)
    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    # ------------------------------------------------------------ LoRA adapters (engine thread)
    def _lora(self, adapter: str | None = None) -> LoraRegistry:
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError(f"{f'adapter {adapter!r}: ' if adapter else ''}LoRA is not enabled on this worker "
                             "(start it with --enable-lora)")
        return lora

    def adapters(self) -> list[LoraAdapter]:
        lora = getattr(self.runner, "lora", None)
        return [] if lora is None else [lora.get(name) for name in lora.names()]

    def load_adapter(self, name: str, path: str) -> LoraAdapter:
        """Load a PEFT adapter while serving; raises LoraError (a ValueError) and loads nothing on any problem."""
        return self._lora(name).load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Refused while any request, running or queued, uses the adapter."""
        lora = self._lora(name)
        adapter = lora.get(name)
        users = sum(1 for r in self.scheduler.live_reqs() if r.lora is adapter)
        if users:
            raise LoraError(f"adapter {name!r}: cannot unload it while {users} requests use it; retry when they finish")
        lora.unload(name)

    # ------------------------------------------------------------ expert distribution (engine thread)
    def start_expert_record(self) -> None:
        """Count every expert layer's routing choices from the next step on, from zero. ValueError: no experts."""
        recorder = self._expert_recorder()
        recorder.start()
        self.runner.model.set_route_hook(recorder.record)

    def stop_expert_record(self) -> None:
        self._expert_recorder().stop()
        self.runner.model.set_route_hook(None)

    def dump_expert_record(self) -> torch.Tensor:
        """Selections per layer and expert since the start or the last dump, [L, E] int64 on the CPU; clears them."""
        return self._expert_recorder().dump()

    def _expert_recorder(self) -> ExpertRecorder:
        if self._experts is None:
            moe = self.model_config.moe
            if moe is None:
                raise no_experts(Path(self.config.model_path).name)
            self._experts = ExpertRecorder(self.model_config.num_layers, moe.num_experts, self.runner.device)
        return self._experts

    # ------------------------------------------------------------ model weights (engine thread; shared/weights.py)
    def stage_weights(self, checkpoint: Checkpoint) -> None:
        """Build `checkpoint`'s weights beside the running ones, which keep serving until commit_weights.
        Replaces weights staged before. Raises WeightsError, and then nothing is staged."""
        self._staged = None  # the previous staged model is freed before the next one is built
        self._staged = (checkpoint.source, self.runner.build_weights(checkpoint))

    @property
    def staged_weights(self) -> str | None:
        """The path of the weights staged, or None."""
        return self._staged[0] if self._staged is not None else None

    def discard_weights(self) -> None:
        self._staged = None

    def commit_weights(self, version: WeightsVersion, abort_reason: str | None = None) -> int | None:
        """Serve the staged weights from the next step on, as `version`, with an empty prefix cache.

        Only once no request is live, so that none mixes two versions (in PD mode: is prefilled with one and
        decoded with the other). `abort_reason`: abort every live request first, with that error. Returns how
        many requests were aborted, or None when requests still run and nothing changed: ask again later."""
        if self._staged is None:
            raise WeightsError("no weights are staged")
        rids = {r.rid for r in self.scheduler.live_reqs()} if abort_reason is not None else set()
        for rid in rids:
            self.abort(rid, error=abort_reason)
        if self.scheduler.live_reqs() or not self.scheduler.flush_cache():  # old KV must never meet new weights
            return None
        self.runner.swap_weights(self._staged[1])
        self._staged = None
        self.weights = version
        log.info("serving weights version %s", version.label)
        return len(rids)

    def check_peer_weights(self, label: str) -> None:
        """Prefill role: refuse KV for a decode worker that serves other weights (the label it sent); ValueError.
        Called on the engine thread, where no commit can come between this check and the request's prefill."""
        if label and label != self.weights.label:
            raise WeightsError(f"the decode worker serves weights version {label} and this prefill worker version "
                               f"{self.weights.label}: KV cannot move between different weights (retry once the "
                               "weight update under way is over, or update the weights again after a worker "
                               "restarted)")

    def load(self) -> dict[str, int]:
        s = self.scheduler
        return {"running": s.num_running, "waiting": len(s.waiting) + len(s.reserving),
                "free_pages": self.allocator.num_free + self.cache.evictable_pages(),
                "total_pages": self.allocator.num_pages, "cached_pages": self.cache.num_pages}
