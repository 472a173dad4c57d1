"""What a worker's front may ask of its engine process for requests (`call_<name>`: generations, the KV of PD
requests, peers, pooling), and how that process builds its engine; what operators ask is in
`engine_admin_calls.py`.

Each call says where it runs (`@runs`): "engine", on the engine thread between steps; "thread", on a host thread
because it blocks (it may wait for the engine in turn); "here", on the channel's thread, for what is cheap and
thread-safe. Arguments and results are plain data (msgpack); a failure reaches the front as its kind and message
(`channel.error_kind`).
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, fields

import torch

from pdserve.services.worker.engine_admin_calls import AdminCalls, runs
from pdserve.services.worker.metrics import WorkerMetrics
from pdserve.services.worker.settings import expert_settings, tp_ranks, transfer_spec, wiring_for
from pdserve.shared.compat import Compat
from pdserve.shared.compute_thread import ComputeThread
from pdserve.shared.config import ModelConfig, Role
from pdserve.shared.engine import Engine
from pdserve.shared.grammar import Constraint
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.outputs import FirstToken, TokenLogprobs
from pdserve.shared.req import Req, TransferTarget
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scoring import (DecoderPooling, ScoreResult, check_inputs, check_sequences, plan_groups,
                                    pool_group, prefill_prefix, score_group, step_budget)
from pdserve.shared.tp_transfer import rank_transfers
from pdserve.shared.transfer.fence import Fence

log = logging.getLogger("pdserve.worker")
GRAMMAR_TIMEOUT_S = 30.0
ENCODE_TIMEOUT_S = 120.0  # for one group of a pooling request, queueing included
PARAM_NAMES = tuple(f.name for f in fields(SamplingParams))
ABORT_WAIT_S = 1.0  # a fence's revocation waits this long for the engine to drop the request, then reports it
# Tests only: every KV write of a prefill worker waits this long first (a write late past its request's abort).
WRITE_DELAY_ENV = "PDSERVE_TEST_KV_WRITE_DELAY_S"
# Tests only: every run of pages read from the storage tier waits this long first (a read under way at an abort).
READ_DELAY_ENV = "PDSERVE_TEST_KV_READ_DELAY_S"


def lps(items) -> TokenLogprobs | None:
    return None if items is None else TokenLogprobs.from_wire(items)


def wire_lps(lp: TokenLogprobs | None):
    return None if lp is None else lp.to_wire()


class EngineCalls(AdminCalls):
    def __init__(self, command: str, args: argparse.Namespace) -> None:
        from pdserve.services.worker.cli import runtime_config, set_torch_threads

        set_torch_threads(args)
        role = Role(command)
        self.wiring = wiring = wiring_for(role)
        self.args = args
        self.config = config = runtime_config(args, args.model_path)
        self.ranks = tp_ranks(args, config, role)  # before the compute thread: it takes rank 0's cores
        self.compute = ComputeThread()  # loads the model, then runs the engine loop: one OpenMP pool
        try:
            runner = self.compute.run(lambda: self._runner(config))
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(timeout_s=0)
            raise
        self.pooled = None  # a pooling decoder (embedding or classifier): served by encode, never generate
        if config.is_embedding or runner.model_config.is_classifier or runner.model_config.is_bare:
            if not wiring.serves_pooling_models:
                raise ValueError(f"{runner.model_config.architecture} with --is-embedding serves embeddings or "
                                 "scores, which need no prefill/decode split: run it as `pdserve colocated`")
            self.pooled = DecoderPooling.for_model(config.model_path, runner.model_config.is_classifier)
            if config.tiers is not None:
                raise ValueError(f"--enable-hierarchical-cache does not apply to {runner.model_config.architecture}: "
                                 "a pooling model's prompts are never read back from a KV tier")
        self.experts = expert_settings(args, f"{role.value}-{args.port}")
        if self.experts.mode is not None and runner.model_config.moe is None:
            raise ValueError(f"--expert-distribution-recorder-mode {self.experts.mode}: the model "
                             f"{runner.model_config.architecture} has no experts (not a Mixture-of-Experts model)")
        self.transfer, self.backend = None, "none"
        spec = transfer_spec(args, wiring)
        if spec is not None:  # every rank of a tensor-parallel worker makes its agent at this point
            self.transfer = rank_transfers(spec, runner.tp, runner)
            self.backend = spec.backend
        self.metrics = WorkerMetrics(args.served_model_name or config.model_path, role, runner.pool.page_size,
                                     runner.pool.num_pages, runner.lora.pool.num_slots if runner.lora else None)
        self.engine = Engine(config, role, runner,
                             transfer_fn=self._write_kv if wiring.transfer == "sender" else None,
                             poll_fn=self.transfer.poll if wiring.transfer == "receiver" else None,
                             observer=self.metrics)
        if self.engine.tiers is not None:
            self.metrics.watch_tiers(host=self.engine.tiers.host is not None,
                                     storage=self.engine.tiers.files is not None)
            self.engine.tiers.read_delay_s = float(os.environ.get(READ_DELAY_ENV) or 0)
        self.runner = runner
        self.starting: dict[str, bool] = {}  # rid -> aborted, while its grammar compiles
        self._starting_lock = threading.Lock()
        self.traced: dict[str, Req] = {}  # rid -> its Req, for the front's spans (engine thread)
        self._grammar_threads = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self._stop_asked = False
        self._write_delay_s = float(os.environ.get(WRITE_DELAY_ENV) or 0)
        if args.random_seed is not None:  # once the model is built: the random init before its weights took draws
            torch.manual_seed(args.random_seed)

    def _runner(self, config) -> ModelRunner:
        if self.ranks is None:
            return ModelRunner(config)
        mc = ModelConfig.from_dir(config.model_path)
        return ModelRunner(config, mc, tp=self.ranks.rank0(mc))

    def info(self) -> dict:
        runner, mc, config = self.runner, self.runner.model_config, self.config
        compat = Compat(model=mc.identity(), dtype=str(runner.dtype).replace("torch.", ""),
                        page_size=config.cache.page_size, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                        head_dim=mc.head_dim, transfer_backend=self.backend,
                        lora_adapters=tuple(sorted(f"{a.name}@{a.version}" for a in self.engine.adapters.list())),
                        weights_version=self.engine.weights.version.label, quantization=config.quantization or "")
        spec = config.speculative
        return {"compat": compat.to_dict(), "max_total_tokens": runner.pool.num_pages * runner.pool.page_size,
                "context_length": runner.context_length,
                "max_running_requests": config.scheduler.max_running_requests,
                "architecture": mc.architecture, "model_type": mc.model_type, "kernels": runner.ops.name,
                "lora_enabled": runner.lora is not None,
                "max_lora_rank": runner.lora.pool.max_rank if runner.lora else 0,
                "max_loras_per_batch": runner.lora.pool.num_slots if runner.lora else 0,
                "weights": asdict(self.engine.weights.version), "generates": self.engine.generates,
                "pooled": self.pooled is not None, "moe": mc.moe is not None, "tp_size": self.args.tp_size,
                "overlap": self.engine.overlap.enabled,
                "speculative_tokens": spec.num_draft_tokens if self.engine.speculator is not None else 0,
                "page_bytes": self.transfer.page_bytes if self.transfer is not None else 0,
                "transfer_name": self.transfer.name if self.transfer is not None else ""}

    def _write_kv(self, req) -> float:
        target = req.transfer
        peer, num_pages = target.peer_name, len(target.dst_pages)
        if self._write_delay_s:
            time.sleep(self._write_delay_s)
        t0 = time.perf_counter()
        try:
            self.transfer.write_pages(peer, req.pages[:num_pages], target.dst_pages,
                                      fence=Fence(target.fence, target.fence_deadline) if target.fence else None)
        except Exception:
            self.metrics.transfer_failed(peer)
            raise
        seconds = time.perf_counter() - t0
        self.metrics.transferred(peer, num_pages * self.transfer.page_bytes, seconds)
        return seconds

    def _request(self, rid: str, input_ids: list[int], params: dict, arrival: float, **more) -> Req:
        sampling = SamplingParams(**{k: v for k, v in params.items() if k in PARAM_NAMES})
        return Req(rid=rid, input_ids=list(input_ids), params=sampling, arrival=arrival, **more)

    def _admit(self, req: Req, add) -> Future:
        """`add()` on the engine thread, after the request's grammar compiled on a thread of its own (the step loop
        never waits for one); an abort that comes meanwhile keeps it from ever starting (`starting`)."""
        if req.params.constraint is None:
            return self.engine.call(add)
        with self._starting_lock:
            self.starting[req.rid] = False

        def compile_then_add():
            try:
                compiled = self._grammar_threads.submit(self.engine.compile_grammar, req.params)
                try:
                    req.grammar = Constraint.for_params(compiled.result(GRAMMAR_TIMEOUT_S), req.params)
                except TimeoutError:
                    raise TimeoutError("the grammar did not compile in time") from None
            except BaseException:
                with self._starting_lock:
                    self.starting.pop(req.rid, None)
                raise

            def add_unless_aborted():
                with self._starting_lock:
                    if self.starting.pop(req.rid, False):
                        raise RuntimeError("aborted while its grammar compiled")
                return add()
            return self.on_engine(add_unless_aborted)
        return self.threads.submit(compile_then_add)

    # ------------------------------------------------------------ generation
    @runs("here")
    def call_generate(self, rid: str, input_ids: list[int], params: dict, arrival: float, lora: str = "",
                      traced: bool = False) -> Future:
        req = self._request(rid, input_ids, params, arrival, on_output=self.emit)
        if self.wiring.transfer == "receiver":  # its prompt's KV is written here by a prefill worker
            req.on_pages_reserved = self._pages_reserved

        def add() -> None:
            self.engine.add_request(req, lora or None)
            if traced:
                self.traced[rid] = req
        return self._admit(req, add)

    def _pages_reserved(self, req: Req) -> None:  # engine thread: the prefill worker may fill them now
        fence = self.transfer.open_window(list(req.pages))
        self.event("reserved", req.rid, list(req.pages), (req.lora and req.lora.version) or "", fence,
                   self.transfer.checks_every_write)

    @runs("engine")
    def call_abort(self, rids: list[str], error: str | None = None) -> list[str]:
        with self._starting_lock:
            for rid in rids:
                if rid in self.starting:
                    self.starting[rid] = True
        return [rid for rid in rids if self.engine.abort(rid, error=error)]

    @runs("engine")
    def call_trace(self, rid: str) -> dict | None:
        """What the front's span of a finished generation says, from its Req (spans.ReqTrace)."""
        req = self.traced.pop(rid, None)
        return None if req is None else trace_of(req)

    # ------------------------------------------------------------ decode: the KV a prefill worker writes
    @runs("thread")
    def call_kv_answered(self, rid: str, pages: list[int], firsts: list, cached_tokens: int) -> float:
        """The prefill worker answered after its last write: close the window before the engine takes the pages
        (caching them may free some for the next request reserved at once); returns when it closed."""
        self._on_kv_thread(lambda: self.transfer.close_window(pages))
        closed = time.monotonic()
        tokens = [FirstToken(t, lps(lp)) for t, lp in firsts]
        self.on_engine(lambda: self.engine.role.kv_ready(rid, tokens, cached_tokens))
        return closed

    @runs("thread")
    def call_kv_settle(self, rid: str, pages: list[int], closed: bool, lease_expired: bool = False) -> None:
        """The reservation's fence is settled (kv_pull.py): no write can land in `pages` once its window is closed;
        an aborted request's pages go back to the pool then."""
        if lease_expired:
            self.metrics.fence_failed("lease_expired")
        if not closed:
            self._on_kv_thread(lambda: self.transfer.close_window(pages))
        self.on_engine(lambda: self.engine.role.kv_settled(rid))

    # ------------------------------------------------------------ prefill: filling a decode worker's pages
    @runs("here")
    def call_prefill(self, rid: str, input_ids: list[int], params: dict, arrival: float, peer_name: str,
                     dst_pages: list[int], lora: str = "", lora_version: str = "", weights_version: str = "",
                     traced: bool = False, fence: int = 0, fence_deadline: float = float("inf")) -> Future:
        if not self.transfer.has_peer(peer_name):  # we restarted since it registered
            raise PermissionError(f"decode worker {peer_name} is not registered")
        req = self._request(rid, input_ids, params, arrival,
                            transfer=TransferTarget(peer_name, list(dst_pages), fence, fence_deadline))

        def admit() -> Future:  # no weight swap can come between the check and the admission on this thread
            self.engine.weights.check_peer(weights_version)
            return self.engine.role.add(req, lora or None, lora_version or None)
        answer = Future()

        def answered(f: Future) -> None:
            try:
                r = f.result()
                if isinstance(r, Future):  # admitted: now the prefill's own result
                    r.add_done_callback(answered)
                    return
            except BaseException as exc:
                answer.set_exception(exc)
                return
            answer.set_result({"first_tokens": [(t.token_id, wire_lps(t.logprob)) for t in r.first_tokens],
                               "cached_tokens": r.cached_tokens, "queue_s": r.queue_s, "compute_s": r.compute_s,
                               "transfer_s": r.transfer_s, "tier_tokens": dict(req.tier_tokens),
                               "input_logprobs": [wire_lps(lp) for lp in r.input_logprobs],
                               "trace": trace_of(req) if traced else None})
        self._admit(req, admit).add_done_callback(answered)
        return answer

    @runs("thread")
    def call_fence(self, rid: str, peer_name: str, fence: int) -> dict:
        """Revoke a reservation's fence (no write of it starts from now on; returns once none is under way), then
        drop its request. What could not be done is logged, counted and answered, never swallowed."""
        errors = []
        fenced = self.transfer.revoke(peer_name, fence)
        if not fenced:  # cannot happen while every write ends within its timeout (fence.WRITE_BOUND_S)
            self.metrics.fence_failed("write_still_running")
            errors.append(f"a KV write of {rid} to {peer_name} was still under way")
        try:
            self.on_engine(lambda: self.engine.abort(rid, error="its KV reservation was revoked"), ABORT_WAIT_S)
        except Exception as exc:  # the abort stays queued; the request's writes are refused meanwhile
            self.metrics.fence_failed("abort_late")
            errors.append(f"the engine did not drop {rid} within {ABORT_WAIT_S:g} s ({type(exc).__name__}): its "
                          "KV writes are refused meanwhile")
        for error in errors:
            log.warning("revoking the KV reservation of %s at %s: %s", rid, peer_name, error)
        return {"fenced": fenced, "error": "; ".join(errors)}

    @runs("here")
    def call_has_peer(self, name: str) -> bool:
        return self.transfer.has_peer(name)

    @runs("thread")
    def call_add_peer(self, name: str, metadata: bytes) -> tuple[bool, bytes]:
        """Connect a registering decode worker (idempotent); returns whether it was known, and our metadata."""
        known = self.transfer.has_peer(name)
        self._on_kv_thread(lambda: self.transfer.add_peer(name, metadata))
        return known, self.transfer.metadata()

    def _on_kv_thread(self, fn):
        """`fn()` here, or on the engine thread in a tensor-parallel worker, whose every rank takes part in a KV
        operation when rank 0's engine thread posts it (the only thread that posts to the ranks)."""
        return fn() if self.runner.tp is None else self.on_engine(fn)

    @runs("engine")
    def call_remove_peer(self, name: str) -> None:  # on the engine thread: no transfer to it is under way
        self.transfer.remove_peer(name)

    @runs("here")
    def call_transfer_metadata(self) -> bytes:
        return self.transfer.metadata()

    @runs("here")
    def call_stop(self) -> None:
        self._stop_asked = True

    def shutdown(self) -> None:
        self.engine.stop()
        if self.transfer is not None:
            self.transfer.close()
        if self.ranks is not None:
            if self.engine.fatal is None:
                self.runner.close()
            self.ranks.close()

    # ------------------------------------------------------------ pooling: scores and embeddings
    @runs("thread")
    def call_encode(self, seqs: list[list[int]], labels: list[int]) -> dict:
        """Each input prefilled through the runtime in groups of at most one prefill chunk of tokens, one engine
        call per group (and per chunk of a longer input), so running generations keep stepping in between."""
        engine, mc = self.engine, self.engine.model_config
        if self.pooled is not None:
            if labels:
                raise ValueError(f"this worker serves {self.pooled.kind}: scoring label tokens needs a generative "
                                 "model")
            check_sequences(seqs, mc.vocab_size, self.runner.context_length)
            run = lambda part: pool_group(engine, part, self.pooled.normalize)  # noqa: E731
        elif not labels:
            raise ValueError("this worker serves a generative model: embeddings need a worker started with "
                             "--is-embedding on an embedding model")
        else:
            check_inputs(seqs, labels, mc.vocab_size, self.runner.context_length)
            run = lambda part: score_group(engine, part, labels)  # noqa: E731
        budget = step_budget(self.config.scheduler)
        vectors: list[list[float]] = []
        prompt = cached = 0
        for group in plan_groups([len(s) for s in seqs], budget):
            part = [seqs[i] for i in group]
            for end in range(budget, len(part[0]), budget) if len(part) == 1 else ():
                self.on_engine(lambda end=end, seq=part[0]: prefill_prefix(engine, seq[:end]), ENCODE_TIMEOUT_S)
            result: ScoreResult = self.on_engine(lambda part=part: run(part), ENCODE_TIMEOUT_S)
            vectors += result.logprobs
            prompt += result.prompt_tokens
            cached += result.cached_tokens
        return {"vectors": vectors, "prompt_tokens": prompt, "cached_tokens": cached}


def trace_of(req: Req) -> dict:
    return {"arrival": req.arrival, "first_scheduled": req.first_scheduled, "first_token_time": req.first_token_time,
            "pages_reserved": req.pages_reserved, "prompt_tokens": len(req.input_ids),
            "cached_tokens": req.cached_tokens, "tier_tokens": dict(req.tier_tokens),
            "output_tokens": len(req.output_ids), "pages": len(req.pages),
            "prefill_chunks": [list(c) for c in req.prefill_chunks], "decode_steps": req.decode_steps,
            "drafted_tokens": req.drafted_tokens, "accepted_tokens": req.accepted_tokens,
            "finish_reason": req.finish_reason,
            "dst_pages": len(req.transfer.dst_pages) if req.transfer is not None else 0}
