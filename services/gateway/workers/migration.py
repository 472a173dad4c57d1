"""Request migration: a generation whose worker pair failed mid-stream continues on another pair.

The new pair is sent the prompt followed by every token the choice has produced so far, as one longer prompt,
and asked for what is left of the budget. The gateway keeps its own per-choice state (detokenizer, stop
strings, the tokens counted for usage), so the client's stream goes on as if nothing happened: no token is
repeated or missing. With greedy decoding on workers in deterministic mode the tokens are those of an
uninterrupted run; a seeded sampled request continues with the same seed (its generator starts afresh, so the
rest of its output is a different sample, as valid as the first).

What cannot be continued this way, and so ends with the failure as before (or starts over, when nothing
has reached the client yet), is marked `unmovable` in the parameter's definition (shared/sampling_params.py):
- n > 1: the choices share one worker request and each has its own tokens;
- grammar constraints: the worker's grammar state would have to be rebuilt from the tokens already out;
- frequency and presence penalties: they count output tokens only, and those tokens would now be prompt.
The repetition penalty moves: it treats prompt and output alike.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.shared.sampling_params import SamplingParams, spec_of


@dataclass(frozen=True)
class Continuation:
    """The worker request that picks a generation up where it stopped."""

    input_ids: list[int]
    params: SamplingParams


def why_not_movable(params: SamplingParams) -> str | None:
    """Why a generation with `params` cannot move to another pair mid-stream (the first field, in the definition's
    order, marked unmovable and not at its default); None when it can."""
    for f in dataclasses.fields(params):
        who = spec_of(f).unmovable
        if who is not None and getattr(params, f.name) != f.default:
            return f"{who} are not moved to another worker mid-stream"
    return None


def continuation(input_ids: list[int], output_ids: list[int], params: SamplingParams) -> Continuation:
    """Prompt + `output_ids` as the new prompt; the budgets reduced by what was produced.

    Prompt logprobs were reported with the first output already, so they are not asked for again (the
    output's own logprobs still are)."""
    produced = len(output_ids)
    rest = dataclasses.replace(params, max_new_tokens=max(0, params.max_new_tokens - produced),
                               min_new_tokens=max(0, params.min_new_tokens - produced), logprob_start_len=-1)
    return Continuation(input_ids + output_ids, rest)
