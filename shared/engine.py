"""Engine: the runtime loop of one worker, in one thread that owns all runtime state.

    role.before_step(); batch = role.schedule(); logits = runner.forward(batch); self.postprocess(batch, logits)

What only a prefill or a decode worker does lives in its role (`shared/roles/`), called at those fixed points;
what an operator changes while serving in `shared/admin.py`; reading a step's tokens late in `shared/overlap.py`.
What a step does with its logits and tokens (account, sample, commit, emit) is `shared/step_ops.py`: the one
object those helpers hold, so none of them imports this module.

Other threads never touch the scheduler, pool or cache: they hand the engine a function with `call(fn)` and get
a Future back. Results leave through each request's `on_output` callback, called from the engine thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch

from pdserve.shared.admin import Adapters, ExpertRecording, ServedWeights
from pdserve.shared.compat import WeightsVersion
from pdserve.shared.compute_thread import ComputeThread
from pdserve.shared.config import Role, RuntimeConfig
from pdserve.shared.grammar import Constraint, Grammars
from pdserve.shared.kv_keys import kv_identity
from pdserve.shared.kv_tier_ranks import TierRanks
from pdserve.shared.kv_tiers import KVTiers
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.observer import RequestObserver
from pdserve.shared.overlap import Overlap, overlap_wanted
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.radix_cache import RadixCache
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.resume import Resume, resumed_choices
from pdserve.shared.roles import TransferFn, make_role
from pdserve.shared.logprobs import prompt_logprobs
from pdserve.shared.sampler import Sampler, make_generator
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch, PoolExhausted, Scheduler
from pdserve.shared.speculative import Speculator
from pdserve.shared.step_ops import StepOps
from pdserve.shared.tp_group import RankGone

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    def __init__(self, config: RuntimeConfig, role: Role = Role.COLOCATED, runner: ModelRunner | None = None,
                 transfer_fn: TransferFn | None = None, poll_fn: Callable[[], None] | None = None,
                 observer: RequestObserver | None = None) -> None:
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.model_config = self.runner.model_config
        # A pooling model (--is-embedding decoder, sequence classifier) has no LM head: nothing to sample.
        mc = self.model_config
        self.generates = not (config.is_embedding or mc.is_classifier or mc.is_bare)
        page_size = self.runner.page_size
        self.allocator = PageAllocator(self.runner.pool.num_pages)
        self.cache = RadixCache(page_size)
        lora = getattr(self.runner, "lora", None)  # runners built for a test may have no adapters at all
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.cache, page_size,
                                   lora.pool if lora is not None else None)
        self.sampler = Sampler()
        self.observer = observer or RequestObserver()
        self.ops = StepOps(self.scheduler, self.runner, self.sampler, self.observer, mc.eos_token_ids, self.abort)
        self.stats = self.ops.stats
        self.role = make_role(role, self.ops, self.add_request, transfer_fn, poll_fn)
        # Only roles that decode draft: a prefill worker samples each request's first token and no more.
        self.speculator = (Speculator(self.ops, config.speculative)
                           if config.speculative is not None and role != Role.PREFILL and self.generates else None)
        self.overlap = Overlap(self.ops, self.role,
                               overlap_wanted(config) and self.speculator is None and self.generates)
        # Called once per loop iteration, after its step: a worker's engine process sends that step's outputs
        # in one message from here.
        self.on_iteration: Callable[[], None] | None = None
        self._inbox: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | ComputeThread | None = None
        self._stopping = False
        self.fatal: Exception | None = None  # what ended the step loop for good (a lost tensor-parallel rank)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        tp = getattr(self.runner, "tp", None)  # a tensor-parallel worker's ranks each store their own KV heads
        self.tiers = KVTiers(config.tiers, self.scheduler, self.runner.pool, kv_identity(config, self.runner),
                             wake=lambda: self.call(lambda: None), model_path=config.model_path,
                             ranks=TierRanks(tp) if tp is not None else None) \
            if config.tiers is not None else None
        self.adapters = Adapters(self.runner, self.scheduler)
        self.experts = ExpertRecording(self.runner, config.model_path)
        self.weights = ServedWeights(self.ops, self.tiers, WeightsVersion(0, config.model_path))

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
            if self.tiers is not None:
                self.tiers.poll()
            self.role.poll()
            if self.has_work():
                try:
                    self.step()
                except RankGone as exc:  # a tensor-parallel worker cannot step without every rank: it goes down
                    log.error("%s: this worker stops, for its supervisor to start it again", exc)
                    self._fail_all(f"the worker lost a tensor-parallel rank: {exc}")
                    self.fatal = exc
                    return
                except Exception as exc:  # a failed step must not leave requests hanging
                    log.exception("engine step failed")
                    self._fail_all(f"internal error: {exc}")
            if self.on_iteration is not None:
                self.on_iteration()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.role.idle_wait_s) if block else self._inbox.get_nowait()
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
        return bool(s.waiting or s.running or s.chunked or self.overlap.pending or self.role.has_work())

    def switch_role(self, kind: Role, transfer_fn: TransferFn | None = None,
                    poll_fn: Callable[[], None] | None = None) -> bool:
        """Engine thread: become a `kind` worker's engine, with the weights, pool, prefix cache and KV tiers as they
        are; False (nothing changed) while a request is still held."""
        if self.has_work() or not self.role.holds_nothing():
            return False
        if self.role in self.scheduler.holders:
            self.scheduler.holders.remove(self.role)
        self.role = self.overlap.role = make_role(kind, self.ops, self.add_request, transfer_fn, poll_fn)
        speculates = self.config.speculative is not None and kind != Role.PREFILL and self.generates
        if not speculates:
            self.speculator = None
        elif self.speculator is None:
            self.speculator = Speculator(self.ops, self.config.speculative)
        return True

    # ------------------------------------------------------------ requests (engine thread)
    def add_request(self, req: Req, lora: str | None = None, lora_version: str | None = None,
                    resume: Resume | None = None) -> None:
        """Queue `req`; `lora` names its adapter (or the path it was loaded from), `lora_version` the version
        the peer worker of a PD pair runs; `resume`: the choices it continues, with their output so far
        (shared/resume.py). Raises ValueError for anything the request cannot run with."""
        req.params.validate(self.model_config.vocab_size)
        if lora:
            req.lora = self.adapters.registry(lora).resolve(lora, lora_version)
        limit = self.runner.context_length
        if len(req.input_ids) == 0:
            raise ValueError("the prompt is empty")
        if len(req.input_ids) >= limit:
            raise ValueError(f"the prompt has {len(req.input_ids)} tokens, which is not shorter than the "
                             f"context length of {limit} tokens")
        if len(req.input_ids) >= self.ops.max_seq_len:  # it would wait for pages forever
            raise ValueError(f"the prompt has {len(req.input_ids)} tokens, which is not shorter than the "
                             f"{self.ops.max_seq_len} tokens this worker's KV pool holds (--max-total-tokens)")
        if req.params.constraint is not None and req.grammar is None:  # callers that did not compile ahead
            req.grammar = Constraint.for_params(self.compile_grammar(req.params), req.params)
        seed = req.params.seed
        for choice in [req] if resume is None else resumed_choices(req, resume, self.model_config.vocab_size, limit):
            choice.generator = make_generator(None if seed is None else seed + choice.index)
            self.role.admit(choice)

    def abort(self, rid: str, reason: str = "abort", error: str | None = None) -> bool:
        self.overlap.settle()  # its tokens first: outputs go out in order, and none stays a placeholder
        reqs = self.scheduler.find(rid)
        for req in reqs:
            self.scheduler.remove(req, cache=req.status >= ReqStatus.RUNNING)
            self.ops.emit(req, finish_reason=reason, error=error)
        self.role.aborted(rid, bool(reqs), error)
        return bool(reqs)

    def _fail_all(self, error: str) -> None:
        self.overlap.drop()
        for req in self.scheduler.live_reqs():
            self.abort(req.rid, error=error)

    # ------------------------------------------------------------ the step
    def step(self) -> None:
        self.role.before_step()
        try:
            batch = self.role.schedule()
        except PoolExhausted as exc:
            self.abort(exc.req.rid, error=str(exc))
            return
        if batch is None:
            self.overlap.settle()
            return
        batch.in_flight = self.overlap.tokens
        start = time.perf_counter()
        if self.speculator is not None and batch.is_decode:
            batch = self.speculator.propose(batch)
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        self.stats.last_step_s = time.perf_counter() - t0
        self.stats.steps += 1
        if self.overlap.launch(batch, logits, self.stats.last_step_s):
            return
        self.overlap.settle()
        if batch.drafts is not None:
            self.speculator.verify(batch, logits)
        else:
            self.postprocess(batch, logits, self.stats.last_step_s)
        if self.speculator is not None and (batch.is_decode or batch.drafts is not None):
            self.speculator.observe(batch, time.perf_counter() - start)

    def postprocess(self, batch: Batch, logits: torch.Tensor, compute_s: float) -> None:
        if batch.prompt_rows:
            prompt_logprobs(batch.prompt_logits, batch.prompt_rows)
            batch.prompt_logits = None
        rows, reqs = self.ops.account(batch, compute_s, self.role.family)
        if reqs:
            tokens, logprobs = self.ops.sample(logits, rows, reqs)
            self.ops.commit(self.role.sampled(reqs, tokens, logprobs, compute_s))

    # ------------------------------------------------------------ inspection (engine thread)
    def flush_cache(self, lower: tuple[str, ...] = ("host", "storage")) -> bool:
        """Empty the prefix cache and the `lower` tiers named ("host": forgotten, "storage": made unreachable)."""
        flushed = self.scheduler.flush_cache()
        if flushed and lower and self.tiers is not None:
            self.tiers.flush(host="host" in lower, storage="storage" in lower)
        return flushed

    def load(self) -> dict[str, int]:
        s = self.scheduler
        load = {"running": s.num_running, "waiting": len(s.waiting) + self.role.num_queued(),
                "free_pages": self.allocator.num_free + self.cache.evictable_pages(),
                "total_pages": self.allocator.num_pages, "cached_pages": self.cache.num_pages}
        if self.speculator is not None:
            load.update(self.speculator.totals())
        return load
