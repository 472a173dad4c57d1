"""The Worker service's live weight update (see WeightsStep in the proto and shared/weights.py): prepare new
weights beside the running ones, swap them in once nothing runs here, or discard them.

A mixin of `rpc.WorkerService`, whose engine, compatibility info and peers it changes.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import compat_to_proto, weights_to_proto
from pdserve.shared.compat import WeightsVersion
from pdserve.shared.weights import CheckpointNotFound, WeightsError

log = logging.getLogger(__name__)

WEIGHTS_BUILD_TIMEOUT_S = 600.0  # for the engine thread to build new weights (a step's worth per layer or so)
WEIGHTS_DRAIN_S = 60.0  # for the requests running here to finish before new weights are swapped in
UPDATE_ABORT_REASON = "aborted: the model weights are being updated (update_weights_from_disk, abort_all_requests)"


class WeightUpdates:
    """UpdateWeights, over the WorkerService's `engine`, `compat`, `info`, `peers`, `on_weights` and
    `_weights_lock` (one step at a time)."""

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context) -> pb.UpdateWeightsReply:
        """One step of a live weight update (see WeightsStep in the proto); any refusal leaves the served weights
        as they were and says why."""
        aborted = 0
        async with self._weights_lock:
            try:
                if request.step == pb.WEIGHTS_DISCARD:
                    await self._engine(self.engine.weights.discard)
                elif not request.model_path:
                    raise WeightsError("model_path is empty")
                elif request.step == pb.WEIGHTS_PREPARE:
                    await self._prepare_weights(request.model_path)
                else:
                    aborted = await self._commit_weights(request)
            except CheckpointNotFound as exc:
                return self._weights_reply(str(exc), path_not_found=True)
            except WeightsError as exc:
                log.warning("weights from %s refused: %s", request.model_path, exc)
                return self._weights_reply(str(exc))
        return self._weights_reply(aborted=aborted)

    async def _prepare_weights(self, path: str) -> None:
        checkpoint = await in_own_thread(lambda: self.engine.runner.read_weights(path))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.call(lambda: self.engine.weights.stage(checkpoint))),
                                   WEIGHTS_BUILD_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise WeightsError(f"building the new weights took more than {WEIGHTS_BUILD_TIMEOUT_S:g} s") from None

    async def _commit_weights(self, request: pb.UpdateWeightsRequest) -> int:
        """Swap the weights in once no request runs here; waits for running ones unless told to abort them."""
        if self.engine.weights.staged != request.model_path:
            await self._prepare_weights(request.model_path)
        version = WeightsVersion(request.version, request.model_path, request.tag)
        reason = UPDATE_ABORT_REASON if request.abort_all_requests else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WEIGHTS_DRAIN_S
        while (aborted := await self._engine(lambda: self.engine.weights.commit(version, reason))) is None:
            if loop.time() > deadline:
                raise WeightsError(f"requests were still running after {WEIGHTS_DRAIN_S:g} s, so the weights were "
                                   "not swapped (retry, or pass abort_all_requests)")
            await asyncio.sleep(0.05)
        self._weights_changed(version)
        return aborted

    def _weights_changed(self, version: WeightsVersion) -> None:
        """What this worker tells the gateway (Info) and its peers (registration) names the new weights."""
        self.compat = replace(self.compat, weights_version=version.label)
        self.info.model_path = version.path
        self.info.weights.CopyFrom(weights_to_proto(version))
        self.info.compat.CopyFrom(compat_to_proto(self.compat))
        if self.peers is not None:
            self.peers.compat = self.compat
        if self.on_weights is not None:
            self.on_weights(self.compat)

    def _weights_reply(self, error: str = "", path_not_found: bool = False, aborted: int = 0) -> pb.UpdateWeightsReply:
        return pb.UpdateWeightsReply(ok=not error, error=error, path_not_found=path_not_found, aborted=aborted,
                                     weights=weights_to_proto(self.engine.weights.version))


async def in_own_thread(fn):
    """`fn` on a thread that ends with it: compute there (converting a GGUF file) must not leave a second
    OpenMP pool alive beside the engine thread's (see shared/compute_thread.py)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="weights-io")
    try:
        return await asyncio.wrap_future(pool.submit(fn))
    finally:
        pool.shutdown(wait=False)
