"""Constrained decoding in the runtime: every output of the default model obeys its grammar, whatever the seed,
for regex, JSON schema, EBNF and structural tags; forks (n > 1) keep their own state; bad grammars are named."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.shared.config import CacheConfig, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.grammar import GrammarError
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["name", "population"], "additionalProperties": False}
PHONE = r"\d{3}-\d{3}-\d{4}"
ANSWER_EBNF = 'root ::= "The answer is " ("yes" | "no") "."'


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    cfg = RuntimeConfig(model_path=str(default_model_dir), dtype="bfloat16",
                        cache=CacheConfig(page_size=16, max_total_tokens=16 * 256))
    return Engine(cfg)


def generate(engine: Engine, prompts: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], tuple]:
    """(rid, choice) -> (token ids, finish reason) of every request, run together in one batch."""
    out: dict[tuple[str, int], list] = {}

    def collect(o):
        entry = out.setdefault((o.rid, o.index), [[], None])
        entry[0].extend(o.token_ids)
        if o.finish_reason is not None:
            entry[1] = o.finish_reason
    for rid, (ids, params) in prompts.items():
        engine.add_request(Req(rid=rid, input_ids=ids, params=params, on_output=collect))
    while engine.has_work():
        engine.step()
    assert engine.scheduler.check_integrity().ok
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_sampled_outputs_obey_every_kind_of_grammar(engine, chat, tokenizer):
    city = json.dumps(CITY)
    prompts = {}
    for seed in range(6):
        sampling = dict(temperature=1.0, seed=seed, max_new_tokens=64)
        prompts[f"json-{seed}"] = (chat("Describe Paris as JSON."), SamplingParams(json_schema=city, **sampling))
        prompts[f"regex-{seed}"] = (chat("Give me a phone number."), SamplingParams(regex=PHONE, **sampling))
        prompts[f"ebnf-{seed}"] = (chat("Is the sky blue?"), SamplingParams(ebnf=ANSWER_EBNF, **sampling))
    prompts["free"] = (chat("Say hi."), SamplingParams(temperature=0, max_new_tokens=8))
    results = generate(engine, prompts)
    for (rid, _), (ids, finish) in results.items():
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if rid.startswith("json"):
            jsonschema.validate(json.loads(text), CITY)
        elif rid.startswith("regex"):
            assert re.fullmatch(PHONE, text), text
        elif rid.startswith("ebnf"):
            assert text in ("The answer is yes.", "The answer is no."), text
        if rid != "free":
            assert finish == "stop", (rid, text)  # the grammar completed, then its end (eos) was the only choice


def test_forks_keep_their_own_grammar_state(engine, chat, tokenizer):
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_new_tokens=16, regex=r"(red|green|blue)( and (red|green|blue))?")
    results = generate(engine, {"n": (chat("Name colors."), params)})
    assert len(results) == 4
    for ids, finish in results.values():
        assert re.fullmatch(params.regex, tokenizer.decode(ids, skip_special_tokens=True)) and finish == "stop"


def test_ignore_eos_still_ends_when_the_grammar_is_complete(engine, chat, tokenizer):
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, regex="(yes|no)")
    [(ids, finish)] = generate(engine, {"a": (chat("Yes or no?"), params)}).values()
    assert tokenizer.decode(ids, skip_special_tokens=True) in ("yes", "no") and finish == "stop"


def test_a_grammar_longer_than_max_tokens_ends_with_length(engine, chat):
    params = SamplingParams(temperature=0, max_new_tokens=3, regex=r"[a-z]{30}")
    [(ids, finish)] = generate(engine, {"a": (chat("Letters please."), params)}).values()
    assert len(ids) == 3 and finish == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_no_token_can_start_ends_the_request_beside_others(engine, chat, temperature):
    # Characters the tokenizer spells with no token (found by the API fuzzer): the mask bans every token. The
    # step once failed on it (a sampled row with nothing to draw), and the request hung holding its pages.
    dead = SamplingParams(temperature=temperature, max_new_tokens=4, regex="\U0006ecccã\x0bÇ\x7f")
    other = SamplingParams(temperature=0, max_new_tokens=3, regex=r"[a-z]{30}")
    out = generate(engine, {"dead": (chat("Go."), dead), "other": (chat("Letters please."), other)})
    assert out[("dead", 0)] == ([], "stop")
    assert len(out[("other", 0)][0]) == 3 and out[("other", 0)][1] == "length"


def test_logit_bias_steers_the_model(engine, chat):
    ids = chat("What is the capital of France?")
    [(plain, _)] = generate(engine, {"a": (ids, SamplingParams(temperature=0, max_new_tokens=1))}).values()
    banned = SamplingParams(temperature=0, max_new_tokens=1, logit_bias={plain[0]: -100})
    [(steered, _)] = generate(engine, {"b": (ids, banned)}).values()
    assert steered != plain


@pytest.mark.parametrize("params, field, words", [
    (SamplingParams(json_schema='{"type": "foo"}'), "json_schema", "Unsupported type"),
    (SamplingParams(json_schema="{oops"), "json_schema", "not valid JSON"),
    (SamplingParams(regex="(ab"), "regex", "parenthesis"),
    (SamplingParams(ebnf="root ::= missing"), "ebnf", "missing"),
    (SamplingParams(structural_tag='{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'), "structural_tag",
     "'begin', 'schema' and 'end'"),
])
def test_bad_grammars_name_their_field(engine, params, field, words):
    with pytest.raises(GrammarError, match=words) as info:
        engine.compile_grammar(params)
    assert info.value.field == field


def test_structural_tag_constrains_only_inside_its_tags(engine):
    tag = {"structures": [{"begin": "<function=get_weather>", "schema": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}, "end": "</function>"}], "triggers": ["<function="]}
    assert engine.compile_grammar(SamplingParams(structural_tag=json.dumps(tag))) is not None


def test_grammar_holds_after_the_reasoning_section(engine, chat, tokenizer):
    """As with a reasoning parser: free text until the end-of-thinking tokens, the grammar after them."""
    ids = chat("Give me a phone number.")
    [(free, _)] = generate(engine, {"free": (ids, SamplingParams(temperature=0, max_new_tokens=3))}).values()
    a, b = free[0], free[1]
    cases = {
        "forced": (SamplingParams(temperature=0, max_new_tokens=24, regex=PHONE, think_end_ids=(a,)), [a]),
        "opened": (SamplingParams(temperature=0, max_new_tokens=24, regex=PHONE, think_start_ids=(a,),
                                  think_end_ids=(b,)), [a, b]),
        "not opened": (SamplingParams(temperature=0, max_new_tokens=24, regex=PHONE, think_start_ids=(49000,),
                                      think_end_ids=(b,)), []),
    }
    results = generate(engine, {rid: (ids, params) for rid, (params, _) in cases.items()})
    for rid, (_, reasoning) in cases.items():
        out, finish = results[(rid, 0)]
        assert out[:len(reasoning)] == reasoning, rid
        assert re.fullmatch(PHONE, tokenizer.decode(out[len(reasoning):], skip_special_tokens=True)), rid
        assert finish == "stop", rid
