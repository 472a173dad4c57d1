"""Engine.switch_role: an engine takes another role only once it holds no request, and keeps its prefix cache.

A decode engine whose request waits for its prompt's KV, or whose aborted request's pages wait for their fence to
settle, stays a decode engine; once settled it becomes a prefill engine. A prompt computed in one role is a prefix
hit in the next.
"""
from __future__ import annotations

import pytest

from fixtures import make_tiny_model
from pdserve.shared.config import CacheConfig, Role, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req, TransferTarget
from pdserve.shared.roles import DecodeRole, PrefillRole
from pdserve.shared.sampling_params import SamplingParams

PROMPT = list(range(3, 3 + 40))  # ten pages of four tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("role-switch") / "llama")


def make_engine(model_dir, role: Role) -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32",
                                cache=CacheConfig(page_size=4, max_total_tokens=4 * 64)), role=role)


def prefill(engine: Engine, rid: str, prompt: list[int]) -> int:
    """One prompt computed by a prefill engine (its KV written nowhere); the tokens it found cached."""
    engine.role.transfer_fn = lambda req: 0.0
    answer = engine.role.add(Req(rid=rid, input_ids=prompt, params=SamplingParams(max_new_tokens=1),
                                 transfer=TransferTarget("decode", list(range(len(prompt) // 4 + 1)))))
    while engine.has_work():
        engine.step()
    return answer.result(timeout=0).cached_tokens


def test_a_decode_engine_switches_only_once_it_holds_no_request(model_dir):
    engine = make_engine(model_dir, Role.DECODE)
    free = engine.allocator.num_free
    engine.add_request(Req(rid="r", input_ids=PROMPT, params=SamplingParams(max_new_tokens=4)))
    engine.step()  # pages reserved: the request waits for its prompt's KV
    assert not engine.switch_role(Role.PREFILL) and isinstance(engine.role, DecodeRole)
    engine.abort("r")  # its pages wait for the reservation's fence to settle
    assert not engine.switch_role(Role.PREFILL) and isinstance(engine.role, DecodeRole)
    engine.role.kv_settled("r")
    decode_role = engine.role
    assert engine.switch_role(Role.PREFILL) and isinstance(engine.role, PrefillRole)
    assert decode_role not in engine.scheduler.holders  # its pages are no longer counted as held
    assert engine.allocator.num_free == free  # every page back


def test_the_prefix_cache_serves_hits_across_switches(model_dir):
    engine = make_engine(model_dir, Role.PREFILL)
    assert prefill(engine, "a", PROMPT) == 0
    assert engine.switch_role(Role.DECODE) and isinstance(engine.role, DecodeRole)
    assert engine.switch_role(Role.PREFILL)
    assert prefill(engine, "b", PROMPT + [7, 8]) >= len(PROMPT) - 4  # computed two roles ago, found now
