"""What a worker's front may ask of its engine process for operators, whatever its role: load and pool figures,
metrics, LoRA adapters, the expert distribution, live weight updates, a live role switch (see `engine_worker.py`
for where calls run)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict

from prometheus_client import generate_latest

from pdserve.services.worker.channel.messages import (Adapters, Experts, FlushCache, Load, LoadAdapter, Metrics,
                                                     PoolStats, StatsSample, SwitchRole, UnloadAdapter, Weights)
from pdserve.services.worker.engine.engine_worker import WorkerEngine, handles
from pdserve.shared.compat import WeightsVersion
from pdserve.shared.config import CACHE_TIERS, Role
from pdserve.shared.expert_recorder import RECORDING_OFF, save_dump, writable_dir
from pdserve.shared.lora import AdapterNotFound, LoraError
from pdserve.shared.weights_digest import weights_digest

log = logging.getLogger("pdserve.worker")
METRICS_REFRESH_S = 0.5  # a scrape never waits longer than this on a step (see metrics.REFRESH_TIMEOUT_S)
WEIGHTS_BUILD_TIMEOUT_S = 600.0
FLUSH_WRITES_WAIT_S = 5.0  # how long a flush waits for the storage tier's writes, which hold their pages


class AdminCalls:
    def __init__(self, worker: WorkerEngine, side_of=None, switched=None) -> None:
        """`side_of(role)`: a role's engine side (engine_process.engine_role); `switched()`: the host serves the
        new role's calls from then on."""
        self.worker = worker
        self.side_of, self.switched = side_of, switched

    @property
    def engine(self):
        return self.worker.engine

    def on_engine(self, fn, timeout: float | None = None):
        return self.worker.on_engine(fn) if timeout is None else self.worker.on_engine(fn, timeout)

    # ------------------------------------------------------------ live role switch
    @handles(SwitchRole, where="thread")
    def switch_role(self, call: SwitchRole) -> dict:
        """Take another role once the engine holds no request (tried every few ms, up to `call.wait_s`); the
        engine's info in it."""
        w, side = self.worker, self.side_of(Role(call.role))
        if not (w.role.switches_roles and side.switches_roles):
            raise ValueError("colocated_worker: only prefill and decode workers switch roles (a colocated worker "
                             "has no KV transfer agent)")
        deadline = time.monotonic() + call.wait_s
        while not w.on_engine(lambda: w.switch_to(side)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"drain_timeout: the engine still held requests after {call.wait_s:g} s")
            time.sleep(0.005)
        self.switched()
        log.info("engine switched to the %s role", call.role)
        return w.info()

    # ------------------------------------------------------------ inspection
    @handles(Load, where="engine")
    def load(self, call: Load) -> dict:
        load = self.engine.load()
        tiers = self.engine.tiers
        if tiers is not None and tiers.files is not None:  # what its directory holds, as of the latest count
            stored = tiers.stats()
            load.update(storage_tier=True, storage_pages=stored["storage_pages"], storage_bytes=stored["storage_bytes"])
        if tiers is not None and tiers.host is not None:
            load.update(host_tier=True, host_pages=tiers.host.used, host_capacity=tiers.host.num_pages)
        return load

    @handles(FlushCache, where="thread")
    def flush_cache(self, call: FlushCache) -> dict:
        """Empty the named tiers of cached KV (none named: every tier). The pool's prefix cache empties only while
        nothing runs; pages the storage tier is still writing are locked until written, so that is waited for."""
        tiers = call.tiers
        unknown = [t for t in tiers if t not in CACHE_TIERS]
        if unknown:
            raise ValueError(f"tiers: unknown tier {unknown[0]!r} (known: {', '.join(CACHE_TIERS)})")
        names = set(tiers or CACHE_TIERS)
        engine = self.engine
        has = {"host": engine.tiers is not None and engine.tiers.host is not None,
               "storage": engine.tiers is not None and engine.tiers.files is not None}
        lower = tuple(t for t in ("host", "storage") if t in names and has[t])
        if "device" not in names:
            if not lower:
                return {"ok": True, "message": f"this worker has no {' or '.join(sorted(names))} tier"}
            self.on_engine(lambda: engine.tiers.flush(host="host" in lower, storage="storage" in lower))
            return {"ok": True, "message": f"{' and '.join(lower)} tier{'s' if len(lower) > 1 else ''} flushed"}

        def attempt() -> bool | None:  # None: only the storage tier's writes stand in the way
            if engine.flush_cache(lower=lower):
                return True
            return None if not engine.scheduler.live_reqs() and engine.tiers is not None and engine.tiers.writing \
                else False

        deadline = time.monotonic() + FLUSH_WRITES_WAIT_S
        while (flushed := self.on_engine(attempt)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if flushed is None:
            return {"ok": False, "message": f"the storage tier's writes did not finish in {FLUSH_WRITES_WAIT_S:g} s; "
                                            "cache not flushed"}
        if not flushed:
            return {"ok": False, "message": "requests are running; cache not flushed"}
        return {"ok": True, "message": f"cache flushed ({' and '.join(('device', *lower))})"}

    @handles(PoolStats, where="engine")
    def pool_stats(self, call: PoolStats) -> dict:
        report = self.engine.scheduler.check_integrity()
        return {"total_pages": report.total, "free_pages": report.free, "used_pages": report.held,
                "cached_pages": report.cached, "radix_nodes": self.engine.cache.num_pages,
                "integrity_ok": report.ok, "integrity_message": report.message}

    @handles(StatsSample, where="engine")
    def stats_sample(self, call: StatsSample) -> tuple:
        spec = self.engine.speculator
        return (self.engine.load(), self.engine.stats.prefill_tokens, self.engine.stats.decode_tokens,
                spec.figures() if spec is not None else None)

    @handles(Metrics, where="thread")
    def metrics(self, call: Metrics) -> bytes:
        def refresh() -> None:  # on the engine thread, whose state the trace records are
            self.worker.metrics.refresh(self.engine)
            self.worker.metrics.trace_records.set(len(self.worker.traced))
        try:
            self.on_engine(refresh, METRICS_REFRESH_S)
        except TimeoutError:
            pass  # a long step: the gauges stay as the previous scrape left them
        return generate_latest(self.worker.metrics.registry)

    # ------------------------------------------------------------ LoRA adapters, experts
    @handles(Adapters, where="engine")
    def adapters(self, call: Adapters) -> list[dict]:
        return [{"name": a.name, "path": str(a.path), "version": a.version, "rank": a.rank,
                 "target_modules": list(a.target_modules)} for a in self.engine.adapters.list()]

    @handles(LoadAdapter, where="engine")
    def load_adapter(self, call: LoadAdapter) -> list[dict]:
        name, path = call.name, call.path
        try:
            self.engine.adapters.load(name, path)
        except AdapterNotFound as exc:  # one answer whatever is at the path: callers learn nothing of the host
            log.warning("%s", exc)
            raise LoraError(f"adapter {name!r}: no PEFT LoRA adapter to load at {path!r} (a directory this worker "
                            "can read, holding adapter_config.json and adapter_model.safetensors)") from None
        return self.adapters(Adapters())

    @handles(UnloadAdapter, where="engine")
    def unload_adapter(self, call: UnloadAdapter) -> list[dict]:
        name = call.name
        self.engine.adapters.unload(name)
        return self.adapters(Adapters())

    @handles(Experts, where="thread")
    def experts(self, call: Experts) -> dict | None:
        """start, stop or dump the expert distribution record; refused (PermissionError) where nothing records."""
        op = call.op
        recording = self.engine.experts
        if self.engine.model_config.moe is not None and self.worker.experts.mode is None:
            raise PermissionError(RECORDING_OFF)
        try:
            if op == "start":
                return self.on_engine(recording.start)
            if op == "stop":
                return self.on_engine(recording.stop)
            writable_dir(self.worker.experts.directory)  # before the counts are cleared: a bad directory loses nothing
            counts = self.on_engine(recording.dump)  # [L, E]
        except ValueError as exc:  # no experts in this model
            raise PermissionError(str(exc)) from None
        try:
            path = save_dump(counts, self.worker.experts.directory, self.worker.experts.tag)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"cannot write the expert distribution: {exc}") from None
        return {"counts": counts.flatten().tolist(), "shape": list(counts.shape), "path": str(path)}

    # ------------------------------------------------------------ live weight updates (see weights_rpc.py)
    @handles(Weights, where="thread")
    def weights(self, call: Weights) -> dict | None:
        """prepare (read and build new weights beside the served ones), commit (swap them in once nothing runs:
        returns None while requests still run), discard, or served (nothing); returns the served version and the
        requests aborted."""
        step, path = call.step, call.path
        weights = self.engine.weights
        if step == "discard":
            self.on_engine(weights.discard)
        elif step == "prepare" or (step == "commit" and weights.staged != path):
            self._prepare(path)
        if step == "commit":
            version = WeightsVersion(call.number, path, call.tag)
            aborted = self.on_engine(lambda: weights.commit(version, call.abort_reason))
            if aborted is None:
                return None
            return {"weights": asdict(weights.version), "aborted": aborted}
        return {"weights": asdict(weights.version), "aborted": 0}

    def _prepare(self, path: str) -> None:
        from pdserve.shared.weights import WeightsError

        # On a thread that ends with it: compute there (converting a GGUF file) must not leave a second OpenMP pool
        # alive beside the engine thread's (see shared/compute_thread.py).
        box: list = []
        reader = threading.Thread(target=lambda: box.append(self._read(path)), name="weights-io")
        reader.start()
        reader.join()
        if isinstance(box[0], BaseException):
            raise box[0]
        try:
            self.on_engine(lambda: self.engine.weights.stage(box[0]), WEIGHTS_BUILD_TIMEOUT_S)
        except TimeoutError:
            raise WeightsError(f"building the new weights took more than {WEIGHTS_BUILD_TIMEOUT_S:g} s") from None

    def _read(self, path: str):
        try:
            checkpoint = self.worker.runner.read_weights(path)
            if self.engine.tiers is not None:  # the digest naming their KV (kv_keys.py), hashed here, not at commit
                weights_digest(checkpoint.directory)
            return checkpoint
        except BaseException as exc:
            return exc

