"""What an operator changes on a running worker: LoRA adapters, expert recording, the served weights.

One class per resource, each given the parts of the engine it changes (never the engine itself). Every method
runs on the engine thread (workers reach it through `Engine.call`), so a change never lands in the middle of a step.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.shared.compat import WeightsVersion
from pdserve.shared.expert_recorder import ExpertRecorder, no_experts
from pdserve.shared.lora import LoraAdapter, LoraError
from pdserve.shared.lora_registry import LoraRegistry
from pdserve.shared.scheduler import Scheduler
from pdserve.shared.step_ops import StepOps
from pdserve.shared.weights import Checkpoint, WeightsError

if TYPE_CHECKING:
    from pdserve.shared.kv_tiers import KVTiers
    from pdserve.shared.model_runner import ModelRunner

log = logging.getLogger(__name__)


class Adapters:
    """The LoRA adapters a worker serves (its runner's registry, when started with --enable-lora)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler

    def registry(self, adapter: str | None = None) -> LoraRegistry:
        lora = getattr(self.runner, "lora", None)  # runners built for a test may have no adapters
        if lora is None:
            raise ValueError(f"{f'adapter {adapter!r}: ' if adapter else ''}LoRA is not enabled on this worker "
                             "(start it with --enable-lora)")
        return lora

    def list(self) -> list[LoraAdapter]:
        lora = getattr(self.runner, "lora", None)
        return [] if lora is None else [lora.get(name) for name in lora.names()]

    def load(self, name: str, path: str) -> LoraAdapter:
        """Load a PEFT adapter while serving; raises LoraError (a ValueError) and loads nothing on any problem."""
        return self.registry(name).load(name, path)

    def unload(self, name: str) -> None:
        """Refused while any request, running or queued, uses the adapter."""
        lora = self.registry(name)
        adapter = lora.get(name)
        users = sum(1 for r in self.scheduler.live_reqs() if r.lora is adapter)
        if users:
            raise LoraError(f"adapter {name!r}: cannot unload it while {users} requests use it; retry when they finish")
        lora.unload(name)


class ExpertRecording:
    """Counts of a Mixture-of-Experts model's routing choices, made at the first recording command."""

    def __init__(self, runner: ModelRunner, model_path: str) -> None:
        self.runner = runner
        self.model_path = model_path
        self._recorder: ExpertRecorder | None = None

    def start(self) -> None:
        """Count every expert layer's routing choices from the next step on, from zero. ValueError: no experts."""
        recorder = self._get()
        recorder.start()
        self.runner.model.set_route_hook(recorder.record)

    def stop(self) -> None:
        self._get().stop()
        self.runner.model.set_route_hook(None)

    def dump(self) -> torch.Tensor:
        """Selections per layer and expert since the start or the last dump, [L, E] int64 on the CPU; clears them."""
        return self._get().dump()

    def _get(self) -> ExpertRecorder:
        if self._recorder is None:
            mc = self.runner.model_config
            if mc.moe is None:
                raise no_experts(Path(self.model_path).name)
            self._recorder = ExpertRecorder(mc.num_layers, mc.moe.num_experts, self.runner.device)
        return self._recorder


class ServedWeights:
    """The weights a worker serves (`version`), and new ones staged beside them (see shared/weights.py)."""

    def __init__(self, ops: StepOps, tiers: KVTiers | None, version: WeightsVersion) -> None:
        self.ops = ops
        self.tiers = tiers
        self.version = version
        # (path, model, the directory it resolved to) built but not yet served
        self._staged: tuple[str, object, Path] | None = None

    def stage(self, checkpoint: Checkpoint) -> None:
        """Build `checkpoint`'s weights beside the running ones, which keep serving until `commit`.
        Replaces weights staged before. Raises WeightsError, and then nothing is staged."""
        self._staged = None  # the previous staged model is freed before the next one is built
        self._staged = (checkpoint.source, self.ops.runner.build_weights(checkpoint), checkpoint.directory)

    @property
    def staged(self) -> str | None:
        """The path of the weights staged, or None."""
        return self._staged[0] if self._staged is not None else None

    def discard(self) -> None:
        if self._staged is not None:
            self._staged = None
            self.ops.runner.discard_weights()

    def commit(self, version: WeightsVersion, abort_reason: str | None = None) -> int | None:
        """Serve the staged weights from the next step on, as `version`, with an empty prefix cache.

        Only once no request is live, so that none mixes two versions (in PD mode: is prefilled with one and
        decoded with the other). `abort_reason`: abort every live request first, with that error. Returns how
        many requests were aborted, or None when requests still run and nothing changed: ask again later."""
        if self._staged is None:
            raise WeightsError("no weights are staged")
        ops = self.ops
        rids = {r.rid for r in ops.scheduler.live_reqs()} if abort_reason is not None else set()
        for rid in rids:
            ops.abort(rid, error=abort_reason)
        if ops.scheduler.live_reqs() or not ops.scheduler.flush_cache():  # old KV never meets new weights
            return None
        ops.runner.swap_weights(self._staged[1])
        if self.tiers is not None:  # the old weights' stored KV stays, for the workers still on them, unreachable here
            self.tiers.weights_changed(str(self._staged[2]))
        self._staged = None
        self.version = version
        log.info("serving weights version %s", version.label)
        return len(rids)

    def check_peer(self, label: str) -> None:
        """Refuse KV for a peer that serves other weights (the label it sent); WeightsError, a ValueError.
        On the engine thread, no commit can come between this check and the request's prefill."""
        if label and label != self.version.label:
            raise WeightsError(f"the decode worker serves weights version {label} and this prefill worker version "
                               f"{self.version.label}: KV cannot move between different weights (retry once the "
                               "weight update under way is over, or update the weights again after a worker "
                               "restarted)")
