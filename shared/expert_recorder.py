"""ExpertRecorder: how often each expert of each MoE layer is chosen, counted while recording.

Lifecycle, as SGLang's `stat` mode: `start()` clears the counts and starts counting; `stop()` stops and keeps
them; `dump()` hands them back and clears them (recording, if on, goes on). The engine installs `record` as the
model's route hook only while recording, so a worker that is not recording pays nothing.

`record` runs on the engine thread inside the forward pass: one `index_add_` into the [L, E] counts, on the
model's device, per expert layer and step; nothing reaches the host before `dump`.

`save_dump` writes SGLang's `stat` file: `torch.save` of {"rank": 0, "logical_count": int64 [1, L, E],
"average_utilization_rate_over_window": None} named `expert_distribution_recorder_<time.time()>.pt`. SGLang's
leading dimension holds one row per forward pass (a circular buffer of the last 1000 passes, int32); ours holds
one int64 row, the total of the whole recording, so `logical_count.sum(0)` means the same in both.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MODES = ("stat",)
RECORDING_OFF = ("Expert distribution recording is off: start the workers with "
                 "--expert-distribution-recorder-mode stat.")


@dataclass(frozen=True)
class RecordSettings:
    """A worker's expert-distribution recording."""

    mode: str | None = None  # "stat": selections per layer and expert; None: the endpoints are refused
    directory: str = "/tmp"  # where dumps are written
    tag: str = ""  # ends this worker's file names (its role and port), so workers sharing a directory never collide


def no_experts(model: str) -> ValueError:
    return ValueError(f"The model {model!r} has no experts (it is not a Mixture-of-Experts model): there is no "
                      "expert distribution to record.")


class ExpertRecorder:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        """`num_layers`: all the model's layers (rows of dense layers stay zero, as in SGLang's files)."""
        import torch  # here, not at import: a worker's front reads MODES for its flags and never loads torch

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)  # [L, E]
        self._one = torch.ones(1, dtype=torch.int64, device=device)
        self.recording = False

    def start(self) -> None:
        if self.recording:
            log.warning("expert distribution: already recording; starting again from zero")
        self.counts.zero_()
        self.recording = True

    def stop(self) -> None:
        if not self.recording:
            log.warning("expert distribution: stop without a start")
        self.recording = False

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """The route hook: topk_ids [T, k], the experts each of the step's T tokens goes to in `layer_id`."""
        ids = topk_ids.reshape(-1)
        self.counts[layer_id].index_add_(0, ids, self._one.expand(ids.numel()))

    def dump(self) -> torch.Tensor:
        """The counts so far, [L, E] int64 on the CPU; they start again from zero."""
        counts = self.counts.to("cpu", copy=True)
        self.counts.zero_()
        return counts


def writable_dir(directory: str | Path) -> Path:
    """`directory`, made if missing; ValueError naming it when no file can be written there."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the expert distribution directory {str(path)!r}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write to the expert distribution directory {str(path)!r}")
    return path


def save_dump(counts: torch.Tensor, directory: str | Path, tag: str = "") -> Path:
    """Write counts [L, E] as SGLang's stat file in `directory`; returns its path. Written whole or not at all."""
    import torch

    name = f"expert_distribution_recorder_{time.time()}{'_' + tag if tag else ''}.pt"
    path = writable_dir(directory) / name
    data = {"rank": 0, "logical_count": counts.to(torch.int64).unsqueeze(0),  # [1, L, E]
            "average_utilization_rate_over_window": None}
    partial = path.with_name(path.name + ".partial")
    torch.save(data, partial)
    os.replace(partial, path)
    log.info("wrote the expert distribution to %s", path)
    return path
