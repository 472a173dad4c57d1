"""A new sampling parameter takes three edits: its field in SamplingParams, its proto field, and its rule in the
sampler. Here a toy one, `max_count` (no token may be sampled once the text, prompt and output, holds it that
many times), is added the way such a change adds it: a field declared in a subclass, and a `Ban` appended to the
sampler's BANS (the proto field only carries it between processes, tests/shared/test_param_definitions.py).
Nothing else is edited, and the parameter holds in a colocated engine, under speculative decoding (whose verify
step asks the sampler which rows it may sample ahead), across a prefill/decode pair and in a generation migration
resumes on another worker (a decode worker, from the output so far).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import Future

import pytest

from fixtures import make_tiny_model
from pdserve.services.gateway.workers.migration import why_not_movable
from pdserve.shared import sampler
from pdserve.shared.config import CacheConfig, Role, RuntimeConfig, SpeculativeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req, TransferTarget
from pdserve.shared.sampling_params import SamplingParams, param

PROMPT = [5, 9, 17, 9, 5, 33, 2, 41]
MAX_NEW = 40


CAP = 6


@dataclasses.dataclass(frozen=True)
class WithMaxCount(SamplingParams):  # edit 1: the field
    max_count: int = param(0, lo=0)


def _max_count(p, prompt, out, eos):  # edit 3: the sampler's rule (edit 2 is the proto field)
    cap = getattr(p, "max_count", 0)
    return [t for t, n in Counter(prompt + out).items() if n >= cap] if cap else ()


RULE = sampler.Ban(_max_count, steady=lambda p, out: not getattr(p, "max_count", 0))


@pytest.fixture(autouse=True)
def with_the_rule(monkeypatch):
    monkeypatch.setattr(sampler, "BANS", [*sampler.BANS, RULE])


def capped(text: list[int]) -> bool:
    return max(Counter(text).values()) <= CAP


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("max-count") / "llama")


def make_engine(model_dir, role: Role = Role.COLOCATED, speculative: bool = False) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32",
                                cache=CacheConfig(page_size=4, max_total_tokens=4 * 64),
                                speculative=SpeculativeConfig() if speculative else None), role=role)


def run(engine: Engine, prompt: list[int], params: SamplingParams, resume: list[int] | None = None) -> list[int]:
    tokens: list[int] = []
    engine.add_request(Req(rid="r", input_ids=prompt, params=params, on_output=lambda o: tokens.extend(o.token_ids)),
                       resume=None if resume is None else [(0, resume)])
    while engine.has_work():
        engine.step()
    return tokens


def run_pd(prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    """One request through a prefill engine and a decode engine, its KV pages copied from one pool to the other."""
    tokens: list[int] = []
    reserved: list[Req] = []
    decode.add_request(Req(rid="r", input_ids=prompt, params=params, on_output=lambda o: tokens.extend(o.token_ids),
                           on_pages_reserved=reserved.append))
    prefill.role.transfer_fn = lambda req: [decode.runner.pool.buffer[dst].copy_(prefill.runner.pool.buffer[src])
                                            for src, dst in zip(req.pages, req.transfer.dst_pages)] and 0.0
    answer: Future = prefill.role.add(Req(rid="r", input_ids=prompt, params=params,
                                          transfer=TransferTarget("decode", reserved[0].pages)))
    while prefill.has_work():
        prefill.step()
    result = answer.result(timeout=0)
    decode.role.kv_ready("r", result.first_tokens, result.cached_tokens)
    while decode.has_work():
        decode.step()
    return tokens


PARAMS = WithMaxCount(temperature=0, max_new_tokens=MAX_NEW, max_count=CAP)


def test_the_new_parameter_holds_colocated_speculative_and_pd(model_dir):
    plain = run(make_engine(model_dir), PROMPT, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    assert not capped(PROMPT + plain)  # the model repeats itself: the cap has something to change
    params = PARAMS
    colocated = run(make_engine(model_dir), PROMPT, params)
    assert len(colocated) == MAX_NEW and capped(PROMPT + colocated), colocated
    # A verify step samples a greedy draft's positions side by side only where the sampler says each ban is
    # steady; this one moves with every token, so its positions are sampled one by one, each seeing the last.
    speculating = make_engine(model_dir, speculative=True)
    assert run(speculating, PROMPT, params) == colocated
    assert speculating.speculator.verify_steps > 0  # drafts were verified, not only plain steps taken
    pair = make_engine(model_dir, Role.PREFILL), make_engine(model_dir, Role.DECODE)
    assert run_pd(*pair, PROMPT, params) == colocated


def test_the_new_parameter_moves_with_a_migrated_request(model_dir):
    """Migration resumes the output so far on another worker: a cap on the whole text holds across the move."""
    whole = run(make_engine(model_dir), PROMPT, PARAMS)
    assert why_not_movable(PARAMS) is None
    rest = run(make_engine(model_dir, Role.DECODE), PROMPT, PARAMS, resume=whole[:10])
    assert whole[:10] + rest == whole and capped(PROMPT + whole), whole
