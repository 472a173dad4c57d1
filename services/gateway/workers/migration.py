"""Request migration: a generation whose worker pair failed mid-stream continues on another pair.

The new pair gets the original prompt and parameters, and the choices still running each with every token it has
produced so far (GenerateRequest.resume). The worker restores from those tokens everything its sampler reads as
if it had produced them itself (shared/resume.py): frequency and presence penalty counts, the min/max new-token
budgets counted from the original start, the grammar matcher's state, the seeded draw position (a seeded
choice's draws depend only on seed, choice index and output position), each of the n > 1 siblings its own
output, the logprob settings (prompt logprobs were reported with the first output and are not computed again).
It computes the KV of prompt + output (the recompute path: the KV is gone with the failed worker) and streams only
new tokens. The gateway keeps its own per-choice state (detokenizer, stop strings, the tokens counted for usage),
so the client's stream goes on as if nothing happened: no token is repeated or missing, and on workers in
deterministic mode the text is that of an undisturbed run.

A parameter whose worker state could not be rebuilt from the output so far would be marked `unmovable` in its
definition (shared/sampling_params.py): such a generation ends with the failure (or starts over, when nothing
has reached the client yet), and the error names it. No parameter is so marked today.
"""
from __future__ import annotations

import dataclasses

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import resume_to_proto
from pdserve.shared.sampling_params import SamplingParams, spec_of


def why_not_movable(params: SamplingParams) -> str | None:
    """Why a generation with `params` cannot move to another pair mid-stream (the first field, in the definition's
    order, marked unmovable and not at its default); None when it can."""
    for f in dataclasses.fields(params):
        who = spec_of(f).unmovable
        if who is not None and getattr(params, f.name) != f.default:
            return f"{who} are not moved to another worker mid-stream"
    return None


def continuation(outputs: list[list[int] | None]) -> list[pb.ResumedChoice]:
    """GenerateRequest.resume of a generation whose choices have produced `outputs` (by choice index; None for a
    choice that has ended, which does not run again)."""
    return resume_to_proto({i: ids for i, ids in enumerate(outputs) if ids is not None})
