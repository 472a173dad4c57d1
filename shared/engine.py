"""Engine: the runtime loop of one worker, in one thread that owns all runtime state.

    role.before_step(); batch = role.schedule(); logits = runner.forward(batch); self.postprocess(batch, logits)

What only a prefill or a decode worker does lives in its role (`shared/roles/`), called at those fixed points;
what an operator changes while serving in `shared/admin.py`; reading a step's tokens late in `shared/overlap.py`.

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
from pdserve.shared.grammar import Constraint, Grammars, apply_masks
from pdserve.shared.kv_keys import kv_identity
from pdserve.shared.kv_tier_ranks import TierRanks
from pdserve.shared.kv_tiers import KVTiers
from pdserve.shared.host_memory import upload
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.observer import RequestObserver, StepStats
from pdserve.shared.outputs import ReqOutput, TokenLogprobs
from pdserve.shared.overlap import Overlap
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.radix_cache import RadixCache
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.roles import TransferFn, make_role
from pdserve.shared.logprobs import HostCopy, prompt_logprobs
from pdserve.shared.sampler import Sampler, make_generator
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch, PoolExhausted, Scheduler
from pdserve.shared.seeded_draws import position_generator
from pdserve.shared.speculative import Speculator
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
        self.role = make_role(role, self, transfer_fn, poll_fn)
        # Only roles that decode draft: a prefill worker samples each request's first token and no more.
        self.speculator = (Speculator(self, config.speculative)
                           if config.speculative is not None and role != Role.PREFILL and self.generates else None)
        self.overlap = Overlap(self)
        self.observer = observer or RequestObserver()
        self.stats = StepStats()
        # Called once per loop iteration, after its step: a worker's engine process sends that step's outputs
        # in one message from here.
        self.on_iteration: Callable[[], None] | None = None
        self._inbox: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | ComputeThread | None = None
        self._stopping = False
        self.fatal: Exception | None = None  # what ended the step loop for good (a lost tensor-parallel rank)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.adapters = Adapters(self)
        self.experts = ExpertRecording(self)
        self.weights = ServedWeights(self, WeightsVersion(0, config.model_path))
        tp = getattr(self.runner, "tp", None)  # a tensor-parallel worker's ranks each store their own KV heads
        self.tiers = KVTiers(config.tiers, self.scheduler, self.runner.pool, kv_identity(config, self.runner),
                             wake=lambda: self.call(lambda: None), model_path=config.model_path,
                             ranks=TierRanks(tp) if tp is not None else None) \
            if config.tiers is not None else None

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

    # ------------------------------------------------------------ requests (engine thread)
    def add_request(self, req: Req, lora: str | None = None, lora_version: str | None = None) -> None:
        """Queue `req`; `lora` names its adapter (or the path it was loaded from), `lora_version` the version
        the peer worker of a PD pair runs. Raises ValueError for anything the request cannot run with."""
        req.params.validate(self.model_config.vocab_size)
        if lora:
            req.lora = self.adapters.registry(lora).resolve(lora, lora_version)
        limit = self.runner.context_length
        if len(req.input_ids) == 0:
            raise ValueError("the prompt is empty")
        if len(req.input_ids) >= limit:
            raise ValueError(f"the prompt has {len(req.input_ids)} tokens, which is not shorter than the "
                             f"context length of {limit} tokens")
        req.generator = make_generator(req.params.seed)
        if req.params.constraint is not None and req.grammar is None:  # callers that did not compile ahead
            req.grammar = Constraint.for_params(self.compile_grammar(req.params), req.params)
        self.role.admit(req)

    def abort(self, rid: str, reason: str = "abort", error: str | None = None) -> bool:
        self.overlap.settle()  # its tokens first: outputs go out in order, and none stays a placeholder
        reqs = self.scheduler.find(rid)
        for req in reqs:
            self.scheduler.remove(req, cache=req.status >= ReqStatus.RUNNING)
            self.emit(req, finish_reason=reason, error=error)
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
        rows, reqs = self.account(batch, compute_s)
        if reqs:
            tokens, logprobs = self.sample(logits, rows, reqs)
            self.take(self.role.sampled(reqs, tokens, logprobs, compute_s))

    def account(self, batch: Batch, compute_s: float) -> tuple[list[int], list[Req]]:
        """Book what the step computed; returns the requests that sample a token now and their logit rows."""
        rows: list[int] = []
        reqs: list[Req] = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if req.status == ReqStatus.FINISHED:  # it ended with the overlapped step before (overlap.py)
                continue
            req.num_computed += n
            if batch.is_decode or req.status == ReqStatus.RUNNING:  # a decode, alone or beside prefills
                self.stats.decode_tokens += 1
                req.decode_steps += 1
                rows.append(i)
                reqs.append(req)
                continue
            self.stats.prefill_tokens += n
            ended = time.monotonic()
            req.prefill_chunks.append((ended - compute_s, ended, n))
            if req.first_scheduled is None:  # its first chunk: it left the queue when this step began
                req.first_scheduled = ended - compute_s
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
            # A fresh prompt with n > 1 becomes n choices; a retracted request recomputed is one already.
            for member in ([req] if req.output_ids else self.role.family(req)):
                rows.append(i)
                reqs.append(member)
        return rows, reqs

    def join(self, req: Req) -> None:  # a request whose prompt is computed decodes from the next step on
        if req.status != ReqStatus.RUNNING:
            req.status = ReqStatus.RUNNING
            self.scheduler.running.append(req)

    def take(self, decoding: list[tuple[Req, int, TokenLogprobs | None]]) -> None:
        """Each request's sampled token: it joins the running batch, takes the token (finishing by the stop and
        length rules), and its output leaves. A read step's tokens and decode's first tokens from its prefill
        worker come here. Two callers append and send themselves: an overlapped step when it settles (a request
        retracted since its launch must not join again), and a verify step (whether an accepted draft token
        counts depends on the one before)."""
        for req, tok, lp in decoding:
            self.join(req)
            self.append_token(req, tok, lp)
        self.emit_all([req for req, _, _ in decoding])

    def sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]):
        """The next token (and its logprobs, where asked) of each of `reqs`, from `logits[rows]`."""
        return self.launch_sample(logits, rows, reqs).read([r.params for r in reqs])

    def launch_sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]) -> HostCopy:
        """`sample`, with the tokens left on their way to the host (read them with `.read(params)`)."""
        if rows != list(range(logits.shape[0])):
            logits = logits[upload(rows, torch.int64, logits.device)]  # a mixed step, or n > 1 choices
        if any(r.grammar is not None for r in reqs):
            apply_masks(logits, [r.grammar for r in reqs])
        # A seeded choice's draws at output position i come from (seed + choice index, i), whichever worker
        # samples it (len(output_ids) counts an overlapped step's placeholders: it is the position).
        generators = [position_generator(r.generator, None if r.params.seed is None else r.params.seed + r.index,
                                         len(r.output_ids)) for r in reqs]
        return HostCopy(self.sampler.sample(logits, [r.params for r in reqs], [r.input_ids for r in reqs],
                                            [r.output_ids for r in reqs], generators,
                                            self.model_config.eos_token_ids))

    def append_token(self, req: Req, token: int, logprob: TokenLogprobs | None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.params.max_new_tokens == 0:  # computed for its prompt's logprobs only: the token is not output
            if logprob is not None:  # but the next position's logprobs are (SGLang's scoring of token ids)
                req.output_logprobs.append(logprob)
            req.finish_reason = "length"
            self.scheduler.remove(req, cache=True)
            return
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

    # ------------------------------------------------------------ outputs
    def emit_all(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.emit(req, finish_reason=req.finish_reason, matched=req.matched_stop_token)

    def emit(self, req: Req, finish_reason: str | None = None, matched: int | None = None,
              error: str | None = None) -> None:
        if req.on_output is None:
            return
        new_ids = req.output_ids[req.num_sent:]
        new_lps = req.output_logprobs[req.num_sent:] if req.output_logprobs else []
        if not new_ids and finish_reason is None:
            return
        first = req.num_sent == 0
        req.num_sent = len(req.output_ids)
        self.observer.output(req, len(new_ids), finish_reason)
        prompt_lps = None
        if req.input_logprobs and not req.input_logprobs_sent and req.index == 0:
            prompt_lps, req.input_logprobs_sent = req.input_logprobs, True
        out = ReqOutput(req.rid, req.index, new_ids, new_lps, finish_reason, matched,
                        prompt_tokens=len(req.input_ids), cached_tokens=req.cached_tokens, error=error,
                        input_logprobs=prompt_lps)
        if first:
            out.first_token_time, out.arrival, out.tier_tokens = req.first_token_time, req.arrival, req.tier_tokens
            started = req.first_scheduled if req.first_scheduled is not None else req.pages_reserved
            if started is not None:
                out.queue_s = started - req.arrival
                if req.first_scheduled is not None and req.first_token_time is not None:
                    out.compute_s = req.first_token_time - req.first_scheduled
        req.on_output(out)

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
