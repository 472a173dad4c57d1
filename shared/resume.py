"""Resumed choices: a generation that continues here where it stopped on another worker (migration).

Invariant: a resumed choice is a Req whose sampler state is what it would be had this worker produced its output
so far itself. The sampler keeps no state between steps (shared/sampler.py): frequency and presence penalty
counts, the min/max new-token budgets and stop tokens are read from `output_ids` each step, and a seeded choice's
draws depend only on (seed + choice index, output position) (shared/seeded_draws.py), so carrying the output
carries them all. The grammar matcher is the one state of its own, and is advanced here over those tokens; the
speculative drafter rebuilds its n-gram index from prompt + output when it first drafts (shared/speculative.py).

Its KV is computed here as a retracted request's is: prompt + output so far in one prefill, prefix cache hits
included. Its next token is output position len(output_ids), and `num_sent` starts past the carried tokens, so
its stream carries only new ones; its prompt logprobs were reported where it started and are not computed again.
"""
from __future__ import annotations

from pdserve.shared.req import Req

Resume = list[tuple[int, list[int]]]  # (choice index, its output so far) of each choice still running


def resumed_choices(req: Req, resume: Resume, vocab_size: int, context_length: int) -> list[Req]:
    """The choices of `req` that continue where they stopped (the first listed is `req` itself, the others its
    siblings); ValueError for a resume that no run of `req` could have left."""
    p = req.params
    if not resume:
        raise ValueError("resume: no choice to continue")
    fresh = req.grammar  # every choice's matcher forks from the start state, before any advances
    choices: list[Req] = []
    for index, outputs in resume:
        _check(req, index, outputs, {c.index for c in choices}, vocab_size, context_length)
        choice = req if not choices else Req(rid=req.rid, input_ids=req.input_ids, params=p, on_output=req.on_output,
                                             on_pages_reserved=req.on_pages_reserved, arrival=req.arrival)
        choice.index = index
        choice.lora = req.lora
        choice.output_ids = list(outputs)
        choice.num_sent = choice.resumed = len(outputs)
        if fresh is not None:
            choice.grammar = fresh if choice is req else fresh.fork()
        choices.append(choice)
    for choice in choices:
        if choice.grammar is not None:
            _advance(choice)
    return choices


def _check(req: Req, index: int, outputs: list[int], seen: set[int], vocab_size: int, context_length: int) -> None:
    p = req.params
    if not 0 <= index < p.n:
        raise ValueError(f"resume: choice {index} is not one of the request's n = {p.n} choices")
    if index in seen:
        raise ValueError(f"resume: choice {index} is listed twice")
    bad = next((t for t in outputs if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"resume: choice {index}'s output holds token id {bad}, outside the vocabulary of "
                         f"{vocab_size}")
    if len(outputs) >= p.max_new_tokens:
        raise ValueError(f"resume: choice {index} has {len(outputs)} output tokens, as many as its max_new_tokens "
                         f"({p.max_new_tokens}): it is finished")
    if len(req.input_ids) + len(outputs) >= context_length:
        raise ValueError(f"resume: choice {index}'s prompt and output ({len(req.input_ids)} + {len(outputs)} "
                         f"tokens) reach the context length of {context_length} tokens: it is finished")


def _advance(choice: Req) -> None:
    for position, token in enumerate(choice.output_ids):
        if not choice.grammar.accept(token):
            raise ValueError(f"resume: choice {choice.index}'s output token {position} ({token}) is not allowed "
                             "by its grammar there")
