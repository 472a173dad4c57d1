"""SamplingParams: every out-of-range value is refused with a message naming its field; the gRPC form round-trips."""
from __future__ import annotations

import math

import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto.codec import params_from_proto as from_proto, params_to_proto as to_proto
from pdserve.shared.sampling_params import MAX_STOP_TOKEN_IDS, InvalidParam, SamplingParams

VOCAB = 49152

INVALID = [
    ("temperature", -1.0, "temperature must be >= 0, got -1.0"),
    ("temperature", math.nan, "temperature must be a finite number, got nan"),
    ("temperature", math.inf, "temperature must be a finite number, got inf"),
    ("temperature", "hot", "temperature must be a number, got 'hot'"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", -0.1, "top_p must be in (0, 1], got -0.1"),
    ("top_k", -2, "top_k must be -1 or 0 (no limit) or >= 1, got -2"),
    ("top_k", 1.5, "top_k must be an integer, got 1.5"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", 1.1, "min_p must be in [0, 1], got 1.1"),
    ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -2.01, "frequency_penalty must be in [-2, 2], got -2.01"),
    ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2], got 3.0"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 2], got 0.0"),
    ("repetition_penalty", 2.5, "repetition_penalty must be in (0, 2], got 2.5"),
    ("max_new_tokens", -1, "max_new_tokens must be >= 0, got -1"),
    ("max_new_tokens", 2**31, "max_new_tokens must be <= 2147483647, got 2147483648"),
    ("min_new_tokens", -1, "min_new_tokens must be >= 0, got -1"),
    ("n", 0, "n must be in [1, 128], got 0"),
    ("n", 129, "n must be in [1, 128], got 129"),
    ("top_logprobs_num", -1, "top_logprobs_num must be in [0, 20], got -1"),
    ("top_logprobs_num", 21, "top_logprobs_num must be in [0, 20], got 21"),
    ("stop_token_ids", (5, VOCAB), f"stop_token_ids must hold token ids in [0, {VOCAB - 1}], got {VOCAB}"),
    ("stop_token_ids", (-1,), f"stop_token_ids must hold token ids in [0, {VOCAB - 1}], got -1"),
    ("stop_token_ids", 7, "stop_token_ids must be a list of token ids, got 7"),
    ("seed", 2**64, f"seed must be in [{-2**63}, {2**63 - 1}], got {2**64}"),
    ("seed", "42", "seed must be an integer, got '42'"),
    ("ignore_eos", "yes", "ignore_eos must be true or false, got 'yes'"),
    ("return_logprob", 1, "return_logprob must be true or false, got 1"),
]


@pytest.mark.parametrize("field,value,message", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_value_is_refused_naming_the_field(field, value, message):
    with pytest.raises(InvalidParam) as info:
        SamplingParams(**{field: value}).validate(VOCAB)
    assert info.value.field == field
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_min_new_tokens_above_max_new_tokens_is_refused():
    with pytest.raises(InvalidParam, match=r"min_new_tokens must be <= max_new_tokens \(4\), got 5") as info:
        SamplingParams(max_new_tokens=4, min_new_tokens=5).validate()
    assert info.value.field == "min_new_tokens"


def test_stop_token_ids_are_checked_against_the_vocabulary_only_when_it_is_known():
    params = SamplingParams(stop_token_ids=(VOCAB + 10,))
    params.validate()
    with pytest.raises(InvalidParam):
        params.validate(VOCAB)


EDGES = [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1), dict(top_k=0), dict(top_k=1),
    dict(min_p=0.0), dict(min_p=1.0), dict(frequency_penalty=-2.0), dict(frequency_penalty=2.0),
    dict(presence_penalty=-2.0), dict(presence_penalty=2.0), dict(repetition_penalty=2.0),
    dict(repetition_penalty=0.01), dict(max_new_tokens=0), dict(max_new_tokens=7, min_new_tokens=7), dict(n=128),
    dict(top_logprobs_num=20), dict(stop_token_ids=(0, VOCAB - 1)), dict(seed=0), dict(seed=-(2**63)),
    dict(temperature=2, top_k=5),  # integers where floats are expected
]


@pytest.mark.parametrize("values", EDGES, ids=[str(e) for e in EDGES])
def test_values_at_the_edges_of_their_range_are_accepted(values):
    SamplingParams(**values).validate(VOCAB)


def test_greedy_means_zero_temperature_or_top_k_one():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-9).is_greedy
    assert SamplingParams(temperature=1.5, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams().is_greedy


def test_stop_token_ids_given_as_a_list_become_a_tuple():
    params = SamplingParams(stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(3, 4)))


def test_proto_round_trip_keeps_every_field():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, frequency_penalty=-0.3,
                            presence_penalty=1.1, repetition_penalty=1.15, max_new_tokens=77, min_new_tokens=3,
                            stop_token_ids=(2, 99), ignore_eos=True, seed=-12345678901, n=4, return_logprob=True,
                            top_logprobs_num=5, logit_bias={7: -100, 3: 2.5}, regex=r"\d+")
    msg = to_proto(params)
    assert isinstance(msg, pb.SamplingParams)
    back = from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert back == params  # floats survive the float32 wire format as the same short decimals


def test_proto_constraint_distinguishes_unset_from_empty():
    assert from_proto(to_proto(SamplingParams())).json_schema is None
    assert from_proto(to_proto(SamplingParams(ebnf=""))).ebnf == ""


def test_logit_bias_is_normalised_and_checked():
    assert SamplingParams(logit_bias={9: 1, 2: -1}).logit_bias == ((2, -1), (9, 1))
    with pytest.raises(InvalidParam, match=r"logit_bias keys must be token ids in \[0, 99\], got 100"):
        SamplingParams(logit_bias={100: 1}).validate(vocab_size=100)
    with pytest.raises(InvalidParam, match=r"logit_bias values must be numbers in \[-100, 100\], got 101"):
        SamplingParams(logit_bias={1: 101}).validate()


def test_only_one_grammar_constraint():
    with pytest.raises(InvalidParam, match="only one of json_schema, regex, ebnf and structural_tag") as info:
        SamplingParams(regex="a", ebnf='root ::= "a"').validate()
    assert info.value.field == "ebnf"
    assert SamplingParams(regex="a+").constraint == ("regex", "a+")


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_proto_seed_distinguishes_unset_from_zero(seed):
    assert from_proto(to_proto(SamplingParams(seed=seed))).seed == seed


def test_proto_defaults_round_trip():
    assert from_proto(to_proto(SamplingParams())) == SamplingParams()
    assert from_proto(to_proto(SamplingParams(temperature=0))).is_greedy


def test_proto_message_with_unset_fields_is_refused_not_read_as_defaults():
    with pytest.raises(InvalidParam) as info:  # as the worker's edge (Engine.add_request) validates it
        from_proto(pb.SamplingParams(temperature=1.0)).validate()  # top_p left at proto3's 0
    assert info.value.field == "top_p"


def test_proto_message_out_of_range_is_refused():
    msg = to_proto(SamplingParams())
    msg.n = 500
    with pytest.raises(InvalidParam, match=r"n must be in \[1, 128\], got 500"):
        from_proto(msg).validate()


def test_token_lists_are_capped_at_the_workers_edge():
    # Checked at every generated token: a worker refuses more ids than MAX_STOP_TOKEN_IDS, whoever sends them.
    SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS))).validate(50_000)
    for name in ("stop_token_ids", "think_end_ids"):
        with pytest.raises(InvalidParam, match=f"at most {MAX_STOP_TOKEN_IDS}") as exc:
            SamplingParams(**{name: tuple(range(MAX_STOP_TOKEN_IDS + 1))}).validate(50_000)
        assert exc.value.field == name
