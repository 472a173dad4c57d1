"""Resumed choices (shared/resume.py): a generation continued from the output another worker produced goes on
with the tokens and logprobs of an undisturbed run, in deterministic mode, for every kind of sampler state a
choice carries: penalty counts, a grammar, a seeded position, min_new_tokens counted from the original start,
n > 1 siblings, logprobs (the prompt's not sent again). A resume that no run could have left is refused by name.
"""
from __future__ import annotations

import json

import pytest

from pdserve.kernels import native
from pdserve.shared.config import CacheConfig, RuntimeConfig, SpeculativeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.grammar import Constraint
from pdserve.shared.req import Req
from pdserve.shared.resume import resumed_choices
from pdserve.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="deterministic inference needs the native CPU kernels")

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999}},
        "required": ["name", "population"], "additionalProperties": False}
NEW = 14  # tokens per choice
CUT = 5  # of which the first worker produced these
CASES = {
    "greedy": dict(temperature=0),
    "penalties": dict(temperature=0, frequency_penalty=1.5, presence_penalty=1.0),
    "json": dict(temperature=0, json_schema=json.dumps(CITY), max_new_tokens=40),
    "seeded": dict(temperature=1.0, seed=11),
    "n2": dict(temperature=0.9, seed=4, n=2),
    "logprobs": dict(temperature=0, return_logprob=True, top_logprobs_num=2, logprob_start_len=0),
    "min_new": dict(temperature=0, min_new_tokens=NEW - 1, stop_token_ids=(13,)),
}


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    return Engine(RuntimeConfig(model_path=str(default_model_dir), dtype="float32", deterministic=True,
                                cache=CacheConfig(page_size=16, max_total_tokens=16 * 128)))


@pytest.fixture(scope="module")
def prompt(chat) -> list[int]:
    return chat("Describe the city of Lyon as JSON.")


class Seen:
    """What a client sees of each (rid, choice): tokens, their logprobs, the finish reason, prompt logprobs."""

    def __init__(self) -> None:
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.logprobs: dict[tuple[str, int], list] = {}
        self.finish: dict[tuple[str, int], str | None] = {}
        self.prompt_logprobs: dict[str, int] = {}

    def __call__(self, out) -> None:
        key = (out.rid, out.index)
        self.tokens.setdefault(key, []).extend(out.token_ids)
        self.logprobs.setdefault(key, []).extend((lp.logprob, tuple(lp.top_ids)) for lp in out.logprobs)
        if out.input_logprobs:
            self.prompt_logprobs[out.rid] = len(out.input_logprobs)
        if out.finish_reason is not None:
            self.finish[key] = out.finish_reason


def run(engine: Engine, prompt: list[int], resume: dict | None = None) -> Seen:
    seen = Seen()
    for rid, params in CASES.items():
        req = Req(rid=rid, input_ids=list(prompt), params=SamplingParams(**{"max_new_tokens": NEW, **params}),
                  on_output=seen)
        engine.add_request(req, resume=None if resume is None else resume[rid])
    while engine.has_work():
        engine.step()
    assert engine.scheduler.check_integrity().ok
    return seen


@pytest.fixture(scope="module")
def undisturbed(engine, prompt) -> Seen:
    return run(engine, prompt)


def test_resumed_choices_continue_as_the_undisturbed_run(engine, prompt, undisturbed, tokenizer):
    resume = {rid: [(i, undisturbed.tokens[(rid, i)][:CUT]) for i in range(params.get("n", 1))]
              for rid, params in CASES.items()}
    assert all(len(undisturbed.tokens[key]) > CUT + 2 for key in undisturbed.tokens)
    engine.flush_cache()
    resumed = run(engine, prompt, resume)
    assert set(resumed.tokens) == set(undisturbed.tokens)
    for key, tokens in undisturbed.tokens.items():
        assert resumed.tokens[key] == tokens[CUT:], key  # only new tokens, none repeated or missing
        assert resumed.finish[key] == undisturbed.finish[key], key
    assert undisturbed.tokens[("n2", 0)] != undisturbed.tokens[("n2", 1)]  # each sibling its own output
    assert resumed.logprobs[("logprobs", 0)] == undisturbed.logprobs[("logprobs", 0)][CUT:]
    assert len(resumed.logprobs[("logprobs", 0)]) == NEW - CUT
    assert undisturbed.prompt_logprobs.get("logprobs") and "logprobs" not in resumed.prompt_logprobs
    json.loads(tokenizer.decode(undisturbed.tokens[("json", 0)], skip_special_tokens=True))  # the schema's, whole
    assert undisturbed.finish[("json", 0)] == "stop"
    assert len(undisturbed.tokens[("min_new", 0)]) >= NEW - 1


def test_the_resume_state_is_the_undisturbed_runs(engine, prompt, undisturbed):
    """The state each step reads: output so far (penalty counts, budgets), seeded position, grammar matcher."""
    ids = undisturbed.tokens[("json", 0)]
    params = SamplingParams(**{**CASES["json"], "n": 2, "seed": 4})
    req = Req(rid="state", input_ids=list(prompt), params=params)
    req.grammar = Constraint.for_params(engine.compile_grammar(params), params)
    reference = req.grammar.fork()
    choices = resumed_choices(req, [(1, ids[:CUT]), (0, ids[:2])], engine.model_config.vocab_size, 8192)
    assert [c.index for c in choices] == [1, 0] and choices[0] is req
    assert [c.output_ids for c in choices] == [ids[:CUT], ids[:2]]
    assert [c.num_sent for c in choices] == [CUT, 2] and [c.resumed for c in choices] == [CUT, 2]
    for token in ids[:CUT]:
        assert reference.accept(token)
    rest = ids[CUT:]  # the grammar stands where the undisturbed run's stood: it takes the rest, and ends there
    assert all(choices[0].grammar.accept(t) for t in rest if t not in engine.model_config.eos_token_ids)
    assert choices[0].grammar.terminated or choices[0].grammar.matcher.is_completed()
    assert not choices[1].grammar.accept(ids[CUT])  # the sibling's matcher is its own, two tokens in


def test_a_resumed_choice_drafts_from_its_carried_output_under_speculative_decoding(tiny_models):
    """The n-gram drafter indexes prompt + output when it first drafts: a resumed choice's carried tokens are
    draft material as its own would be, and the output stays the undisturbed run's (a tiny random model, whose
    greedy output soon repeats itself)."""
    model = tiny_models["llama"]

    def engine_for(speculative: bool) -> Engine:
        return Engine(RuntimeConfig(model_path=str(model), dtype="float32",
                                    cache=CacheConfig(page_size=4, max_total_tokens=4 * 64),
                                    speculative=SpeculativeConfig() if speculative else None))
    prompt, params, seen = [5, 9, 17, 9, 5, 33, 2, 41], SamplingParams(temperature=0, max_new_tokens=48), Seen()
    for rid, engine, resume in (("plain", engine_for(False), None), ("moved", engine_for(True), 16)):
        carried = None if resume is None else [(0, seen.tokens["plain", 0][:resume])]
        engine.add_request(Req(rid=rid, input_ids=prompt, params=params, on_output=seen), resume=carried)
        while engine.has_work():
            engine.step()
    assert len(seen.tokens["plain", 0]) == 48 and seen.tokens["moved", 0] == seen.tokens["plain", 0][16:]
    assert engine.speculator.verify_steps > 0  # drafts were verified, not only plain steps taken


@pytest.mark.parametrize("resume, words", [
    ([(2, [1])], "not one of the request's n = 2"),
    ([(0, [1]), (0, [2])], "listed twice"),
    ([(1, [10 ** 7])], "outside the vocabulary"),
    ([(0, list(range(1, NEW + 1)))], "it is finished"),
])
def test_a_resume_no_run_could_leave_is_refused(engine, prompt, resume, words):
    seen = Seen()
    req = Req(rid="bad", input_ids=list(prompt), params=SamplingParams(max_new_tokens=NEW, n=2), on_output=seen)
    with pytest.raises(ValueError, match=words):
        engine.add_request(req, resume=resume)
    assert not engine.has_work()


def test_output_the_grammar_forbids_is_refused(engine, prompt):
    params = SamplingParams(max_new_tokens=NEW, temperature=0, regex="(yes|no)")
    req = Req(rid="bad-grammar", input_ids=list(prompt), params=params)
    with pytest.raises(ValueError, match="not allowed by its grammar"):
        engine.add_request(req, resume=[(0, engine.model_config.eos_token_ids[:1] * 2)])
