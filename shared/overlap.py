"""Overlapped decode steps: step i+1 is scheduled and launched before step i's sampled tokens are read.

On a GPU the host's part of a step (scheduling, building the inputs, launching; then reading the tokens,
finishing requests, sending outputs) and the device's part otherwise take turns, each idle while the other
works. Here a decode step is launched and left in flight: each of its requests gets a placeholder output
token, -(row + 1), that stands for its row of the step's sampled tokens, still on the device (or on their way
to the host: `HostCopy`). The next step is scheduled with the placeholders counted (a request's length, its
pages) and the model runner takes a placeholder input from the in-flight tokens on the device
(`Batch.in_flight`). Only then are the in-flight step's tokens read (`settle`): each placeholder becomes its
token, and stop and length rules, outputs and page release run as after any step.

Prompts overlap too: a prompt computed in step i joins the running requests at once with its placeholder (its
n > 1 choices forked from its pages first), so step i+1 decodes it. What it costs: a request that finishes at
step i is computed once more in step i+1, its row dropped (SGLang's overlap schedule pays the same). What is
read at once instead: a prefill worker's steps (their first tokens go out with the KV), steps asking for prompt
logprobs, verify steps, and steps with a request whose sampling reads its tokens so far on the host (a
grammar's mask, penalties). Anything else that must see final tokens (an abort) settles first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.shared.config import Role, RuntimeConfig
from pdserve.shared.logprobs import HostCopy
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.roles import EngineRole
from pdserve.shared.scheduler import Batch
from pdserve.shared.step_ops import StepOps


def overlap_wanted(config: RuntimeConfig) -> bool:
    """--overlap-schedule asks for it: on, or auto on a GPU (a CPU has no device to keep busy meanwhile)."""
    return config.overlap_schedule == "on" or (config.overlap_schedule == "auto" and config.device != "cpu")


def overlappable(req: Req) -> bool:
    """Its next token can be sampled before its previous one is known on the host."""
    return req.grammar is None and not req.params.has_penalty


@dataclass
class InFlight:
    reqs: list[Req]
    at: list[int]  # where each request's placeholder sits in its output_ids
    copy: HostCopy
    compute_s: float


class Overlap:
    def __init__(self, ops: StepOps, role: EngineRole, enabled: bool) -> None:
        """`enabled` False: every step is read at once, and nothing is ever in flight (the engine's choice:
        speculation reads each step's tokens to draft the next; a model without an LM head samples nothing)."""
        self.ops = ops
        self.role = role
        self.enabled = enabled
        self.pending: InFlight | None = None

    @property
    def tokens(self) -> torch.Tensor | None:
        """The in-flight step's sampled tokens on the device (what placeholders index), or None."""
        return self.pending.copy.out.token_ids if self.pending is not None else None

    def launch(self, batch: Batch, logits: torch.Tensor, compute_s: float) -> bool:
        """Sample `batch` and leave it in flight, settling the step before it (True); False when it must be
        read at once (then nothing was done: the caller settles and processes it as usual)."""
        ops = self.ops
        if (not self.enabled or batch.drafts is not None or batch.prompt_rows or self.role.kind == Role.PREFILL
                or not all(overlappable(r) for r in batch.reqs)):
            return False
        rows, reqs = ops.account(batch, compute_s, self.role.family)
        copy = ops.launch_sample(logits, rows, reqs) if reqs else None
        at = []
        for k, req in enumerate(reqs):
            ops.join(req)  # a prompt just computed decodes in the next step, from its placeholder
            at.append(len(req.output_ids))
            req.output_ids.append(-(k + 1))
        self.settle()
        if reqs:
            self.pending = InFlight(reqs, at, copy, compute_s)
        return True

    def settle(self) -> None:
        """Read the in-flight step's tokens and take them as a step read at once would have."""
        step, self.pending = self.pending, None
        if step is None:
            return
        tokens, logprobs = step.copy.read([r.params for r in step.reqs])
        at = dict(zip(step.reqs, step.at))
        live = [i for i, req in enumerate(step.reqs) if req.status != ReqStatus.FINISHED]  # else: a dropped row
        decoding = self.role.sampled([step.reqs[i] for i in live], [tokens[i] for i in live],
                                     [logprobs[i] for i in live], step.compute_s)
        later = {}
        for req, _, _ in decoding:
            later[req] = req.output_ids[at[req] + 1:]  # the placeholder of the step launched since, if any
            del req.output_ids[at[req]:]
        self.ops.commit(decoding, join=False)  # joined at launch; one retracted since must not join again
        for req, _, _ in decoding:
            if req.status != ReqStatus.FINISHED:
                req.output_ids.extend(later[req])

    def drop(self) -> None:
        """Forget the in-flight step without reading it (after a failed step): its placeholders go."""
        step, self.pending = self.pending, None
        for req, at in zip(step.reqs, step.at) if step is not None else ():
            del req.output_ids[at:]
