"""The Worker service's live weight update (see WeightsStep in the proto and shared/weights.py): prepare new
weights beside the running ones, swap them in once nothing runs here, or discard them. The engine process does
the work (`EngineCalls.call_weights`); this side waits for running requests and tells peers the new version.

A mixin of `rpc.WorkerService`, whose link, compatibility info and wiring (what its peers are told) it changes.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import compat_to_proto, weights_to_proto
from pdserve.services.worker.channel.wire import RemoteError
from pdserve.services.worker.channel.messages import Weights
from pdserve.shared.compat import WeightsVersion

log = logging.getLogger(__name__)

WEIGHTS_BUILD_TIMEOUT_S = 600.0  # for the engine to read and build new weights (a step's worth per layer or so)
WEIGHTS_DRAIN_S = 60.0  # for the requests running here to finish before new weights are swapped in
UPDATE_ABORT_REASON = "aborted: the model weights are being updated (update_weights_from_disk, abort_all_requests)"
STEPS = {pb.WEIGHTS_PREPARE: "prepare", pb.WEIGHTS_COMMIT: "commit", pb.WEIGHTS_DISCARD: "discard"}


class WeightUpdates:
    """UpdateWeights, over the WorkerService's `link`, `compat`, `info`, `wiring`, `on_weights` and
    `_weights_lock` (one step at a time)."""

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context) -> pb.UpdateWeightsReply:
        """One step of a live weight update (see WeightsStep in the proto); any refusal leaves the served weights
        as they were and says why."""
        async with self._weights_lock:
            try:
                if request.step != pb.WEIGHTS_DISCARD and not request.model_path:
                    return self._weights_reply("model_path is empty", served=await self._served())
                if request.step == pb.WEIGHTS_COMMIT:
                    done = await self._commit_weights(request)
                else:
                    done = await self.link.call(Weights(STEPS[request.step], request.model_path),
                                                WEIGHTS_BUILD_TIMEOUT_S)
            except RemoteError as exc:
                if exc.kind not in ("weights", "not_found", "invalid"):
                    raise
                log.warning("weights from %s refused: %s", request.model_path, exc)
                return self._weights_reply(str(exc), path_not_found=exc.kind == "not_found",
                                           served=await self._served())
            except asyncio.TimeoutError:
                return self._weights_reply(f"building the new weights took more than {WEIGHTS_BUILD_TIMEOUT_S:g} s",
                                           served=await self._served())
        return self._weights_reply(aborted=done["aborted"], served=WeightsVersion(**done["weights"]))

    async def _commit_weights(self, request: pb.UpdateWeightsRequest) -> dict:
        """Swap the weights in once no request runs here; waits for running ones unless told to abort them."""
        reason = UPDATE_ABORT_REASON if request.abort_all_requests else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WEIGHTS_DRAIN_S
        while (done := await self.link.call(Weights("commit", request.model_path, request.version, request.tag,
                                                    reason), WEIGHTS_BUILD_TIMEOUT_S)) is None:
            if loop.time() > deadline:
                raise RemoteError("weights", f"requests were still running after {WEIGHTS_DRAIN_S:g} s, so the "
                                             "weights were not swapped (retry, or pass abort_all_requests)")
            await asyncio.sleep(0.05)
        self._weights_changed(WeightsVersion(**done["weights"]))
        return done

    async def _served(self) -> WeightsVersion:
        done = await self.link.call(Weights("served"), self.timeouts.engine_call)
        return WeightsVersion(**done["weights"])

    def _weights_changed(self, version: WeightsVersion) -> None:
        """What this worker tells the gateway (Info) and its peers (registration) names the new weights."""
        self.compat = replace(self.compat, weights_version=version.label)
        self.info.model_path = version.path
        self.info.weights.CopyFrom(weights_to_proto(version))
        self.info.compat.CopyFrom(compat_to_proto(self.compat))
        self.wiring.weights_changed(self.compat)
        if self.on_weights is not None:
            self.on_weights(self.compat)

    @staticmethod
    def _weights_reply(error: str = "", path_not_found: bool = False, aborted: int = 0,
                       served: WeightsVersion | None = None) -> pb.UpdateWeightsReply:
        return pb.UpdateWeightsReply(ok=not error, error=error, path_not_found=path_not_found, aborted=aborted,
                                     weights=weights_to_proto(served) if served is not None else None)
