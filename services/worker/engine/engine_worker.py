"""WorkerEngine: what a worker's engine process is built of (runtime config, tensor-parallel ranks, the model
runner, the engine, its KV transfer agent, its metrics), the threads its calls run on, and the outbox of one
engine loop iteration. The handlers (`engine_calls.py`, `engine_admin_calls.py`, and the role's own:
`colocated_engine.py`, `prefill_engine.py`, `decode_engine.py`) hold one of these, and the channel's host
(`engine_process.py`) sends what the outbox gathered.

Where a call runs (`handles(..., where=)`): "engine", on the engine thread between steps; "thread", on a host
thread because it blocks (it may wait for the engine in turn); "here", on the channel's thread, for what is cheap
and thread-safe.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict

import torch

from pdserve.services.worker.channel.messages import CacheChanged, CacheDomain, Event, OutputRecord, TransferHealth
from pdserve.services.worker.engine.worker_metrics import WorkerMetrics
from pdserve.services.worker.channel.settings import expert_settings, runtime_config, set_torch_threads, tp_ranks
from pdserve.shared.compat import Compat
from pdserve.shared.compute_thread import ComputeThread
from pdserve.shared.config import ModelConfig
from pdserve.shared.engine import Engine
from pdserve.shared.grammar import Constraint
from pdserve.shared.kv_events import CacheEvents
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.req import Req
from pdserve.shared.scoring import DecoderPooling

log = logging.getLogger("pdserve.worker")
ENGINE_TIMEOUT_S = 30.0  # for the engine thread to take a command from a host thread
# Tests only: every run of pages read from the storage tier waits this long first (a read under way at an abort).
READ_DELAY_ENV = "PDSERVE_TEST_KV_READ_DELAY_S"
GRAMMAR_TIMEOUT_S = 30.0


def handles(call: type, where: str = "engine"):
    """Marks the method that handles `call` (a type of channel/messages.py), and where it runs."""
    def mark(fn):
        fn.handles, fn.where = call, where
        return fn
    return mark


def handlers_of(*objects) -> dict[type, object]:
    """Call type -> the bound method of `objects` marked to handle it; each type handled once."""
    table: dict[type, object] = {}
    for obj in objects:
        for name in dir(type(obj)):
            call = getattr(getattr(type(obj), name), "handles", None)
            if call is not None:
                if call in table:
                    raise TypeError(f"{call.__name__} is handled twice")
                table[call] = getattr(obj, name)
    return table


class WorkerEngine:
    def __init__(self, role, args: argparse.Namespace) -> None:
        """`role`: the role's engine-side class (`colocated_engine.ColocatedEngine` or a subclass), which says
        what it adds to the engine (its transfer side, its hooks) and handles its own calls."""
        set_torch_threads(args)
        self.args = args
        self.config = config = runtime_config(args, args.model_path)
        transfer = role.transfer_spec(args)
        self.ranks = tp_ranks(args, config, transfer)  # before the compute thread: it takes rank 0's cores
        self.compute = ComputeThread()  # loads the model, then runs the engine loop: one OpenMP pool
        try:
            runner = self.compute.run(lambda: self._runner(config))
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(timeout_s=0)
            raise
        self.runner = runner
        mc = runner.model_config
        self.pooled = None  # a pooling decoder (embedding or classifier): served by encode, never generate
        if config.is_embedding or mc.is_classifier or mc.is_bare:
            if not role.serves_pooling_models:
                raise ValueError(f"{mc.architecture} with --is-embedding serves embeddings or scores, which need no "
                                 "prefill/decode split: run it as `pdserve colocated`")
            self.pooled = DecoderPooling.for_model(config.model_path, mc.is_classifier)
            if config.tiers is not None:
                raise ValueError(f"--enable-hierarchical-cache does not apply to {mc.architecture}: a pooling "
                                 "model's prompts are never read back from a KV tier")
        self.experts = expert_settings(args, f"{role.role.value}-{args.port}")
        if self.experts.mode is not None and mc.moe is None:
            raise ValueError(f"--expert-distribution-recorder-mode {self.experts.mode}: the model "
                             f"{mc.architecture} has no experts (not a Mixture-of-Experts model)")
        # Every rank of a tensor-parallel worker makes its agent at this point.
        self.transfer, self.backend = role.transfer_agent(transfer, runner)
        self.metrics = WorkerMetrics(args.served_model_name or config.model_path, runner.pool.page_size,
                                     runner.pool.num_pages, runner.lora.pool.num_slots if runner.lora else None,
                                     counts_at_prefill=role.ends_at_prefill)
        self.role = role(self)
        self.engine = Engine(config, role.role, runner, observer=self.metrics, **self.role.engine_hooks())
        if self.engine.tiers is not None:
            self.metrics.watch_tiers(host=self.engine.tiers.host is not None,
                                     storage=self.engine.tiers.files is not None)
            self.engine.tiers.read_delay_s = float(os.environ.get(READ_DELAY_ENV) or 0)
        self.threads = ThreadPoolExecutor(8, thread_name_prefix="engine-host")
        self.traced: dict[str, Req] = {}  # rid -> its Req, for the front's spans (engine thread)
        self.starting: dict[str, bool] = {}  # rid -> aborted, while its grammar compiles
        self._starting_lock = threading.Lock()
        self._grammar_threads = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.stop_asked = False
        # This iteration's outputs and events (engine thread), and what the front was last told.
        self.outputs: list[OutputRecord] = []
        self.events: list[Event] = []
        self._transfer_ok = True
        self._domain = ""
        # What the prefix cache gains and loses, told to the routers with each iteration's outputs.
        self.cache_events = self.engine.cache.events = CacheEvents()
        if self.engine.tiers is not None:
            self.engine.tiers.events = self.cache_events
        if args.random_seed is not None:  # once the model is built: the random init before its weights took draws
            torch.manual_seed(args.random_seed)

    def _runner(self, config) -> ModelRunner:
        if self.ranks is None:
            return ModelRunner(config)
        mc = ModelConfig.from_dir(config.model_path)
        return ModelRunner(config, mc, tp=self.ranks.rank0(mc))

    # ------------------------------------------------------------ threads
    def on_engine(self, fn, timeout: float = ENGINE_TIMEOUT_S):
        """From a host thread: `fn()` on the engine thread, waited for."""
        return self.engine.call(fn).result(timeout)

    def on_kv_thread(self, fn):
        """`fn()` here, or on the engine thread in a tensor-parallel worker, whose every rank takes part in a KV
        operation when rank 0's engine thread posts it (the only thread that posts to the ranks)."""
        return fn() if self.runner.tp is None else self.on_engine(fn)

    def switch_to(self, side) -> bool:
        """Engine thread: take the role whose engine side is `side` (a `ColocatedEngine` subclass) if the engine
        holds no request; its transfer agent serves either direction, so nothing else changes (a tensor-parallel
        worker's other ranks only follow rank 0's posts: they switch with it)."""
        role = side(self)
        if not self.engine.switch_role(side.role, **role.engine_hooks()):
            return False
        self.role = role
        self.metrics.counts_at_prefill = side.ends_at_prefill
        return True

    # ------------------------------------------------------------ admission (generate, prefill)
    def admit(self, req: Req, add) -> Future:
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

    def abort(self, rids: list[str], error: str | None = None) -> list[str]:
        """Engine thread: drop these requests (those still compiling their grammar never start); the rids found."""
        with self._starting_lock:
            for rid in rids:
                if rid in self.starting:
                    self.starting[rid] = True
        return [rid for rid in rids if self.engine.abort(rid, error=error)]

    # ------------------------------------------------------------ the outbox (engine thread)
    def emit(self, out) -> None:
        """A request's `on_output`: kept until the iteration ends."""
        self.outputs.append(OutputRecord.of(out))

    def event(self, event: Event) -> None:
        self.events.append(event)

    def take_step(self) -> tuple[list[OutputRecord], list[Event]]:
        """This iteration's outputs and events (the engine's `on_iteration`), with the changes of state the front
        follows: transfer health, the cache's key domain (before the pages stored under it), the cache's changes."""
        if self.transfer.healthy() != self._transfer_ok:
            self._transfer_ok = not self._transfer_ok
            self.events.append(TransferHealth(self._transfer_ok))
        domain = self.engine.tiers.domain if self.engine.tiers is not None else ""
        if domain != self._domain:
            self._domain = domain
            self.events.append(CacheDomain(domain))
        kv = self.cache_events.drain()
        if kv is not None:
            self.events.append(CacheChanged(*kv[1:]))
        outputs, events, self.outputs, self.events = self.outputs, self.events, [], []
        return outputs, events

    # ------------------------------------------------------------ what the front is told once
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
                "page_bytes": self.transfer.page_bytes, "transfer_name": self.transfer.name}

    def ranks_alive(self) -> bool:
        """Whether every other rank (and node) of a tensor-parallel worker is still there: a step notices a lost
        one itself, this notices it while the worker is idle."""
        if self.ranks is None:
            return True
        from pdserve.shared.tp_group import RankGone

        try:
            self.ranks.check_alive()
        except RankGone as exc:
            log.error("%s: this worker stops, for its supervisor to start it again", exc)
            return False
        return True

    def shutdown(self) -> None:
        self.engine.stop()
        self.transfer.close()
        if self.ranks is not None:
            if self.engine.fatal is None:
                self.runner.close()
            self.ranks.close()
