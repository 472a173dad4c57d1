"""A live move between two decode engines on CPU (shared/roles/move_out.py), with the stand-in model of
test_scheduler.py (its next token is last + 1, so a repeated or missing token shows): the source freezes a running
generation at a step boundary with its sampled token held back, the destination reserves pages for prompt and
output so far and continues from that token, and both pools end with every page free or cached."""
from __future__ import annotations

import time

import pytest

from pdserve.shared.config import Role
from pdserve.shared.outputs import FirstToken, is_moved
from pdserve.shared.roles import move_out
from test_scheduler import assert_integrity, make_engine, make_req, run_until_idle, tokens_of


def running_source(page_size: int, outputs: dict, steps: int = 3, **params):
    """A decode engine whose generation "g" (prompt 10..16) runs `steps` decode steps after its first token."""
    engine = make_engine(page_size=page_size, role=Role.DECODE)
    engine.add_request(make_req("g", list(range(10, 17)), outputs, max_new_tokens=12, **params))
    engine.step()  # its pages reserved
    engine.role.kv_ready("g", [FirstToken(17)], 0)
    for _ in range(steps):
        engine.step()
    return engine


def held(engine) -> int:
    return engine.scheduler.check_integrity().held


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_frozen_generation_continues_exactly_on_another_engine(page_size):
    out_src, out_dst = {}, {}
    src = running_source(page_size, out_src)
    assert src.role.moves.freeze(src.scheduler.find("g"), "drain") == (["g"], [])
    src.step()  # the step boundary: its token is sampled and held back, the generation leaves the batch
    sent = tokens_of(out_src, "g")
    assert sent == list(range(17, 17 + len(sent))) and is_moved(out_src[("g", 0)][-1].error)
    assert not src.scheduler.running and not src.has_work()
    frozen = src.role.moves.frozen_for("g", list(range(10, 17)) + sent)
    assert frozen.token == sent[-1] + 1 and len(frozen.req.pages) == -(-(7 + len(sent)) // page_size)

    dst = make_engine(page_size=page_size, role=Role.DECODE)
    req = make_req("g.1", list(range(10, 17)), out_dst, max_new_tokens=12)
    req.moved_in = True
    dst.add_request(req, resume=[(0, sent)])
    dst.step()  # pages reserved for prompt and output so far, not computed here
    (moved,) = dst.scheduler.find("g.1")
    assert len(moved.pages) == len(frozen.req.pages) and dst.runner.computed == []
    src.role.moves.release("g")
    dst.role.kv_ready("g.1", [FirstToken(frozen.token)], 0)
    run_until_idle(dst)
    assert sent + tokens_of(out_dst, "g.1") == list(range(17, 29))  # 12 tokens, none repeated or missing
    assert all(n == 1 for _, _, n in dst.runner.computed)  # only decode steps: no prompt computed again
    for engine in (src, dst):
        assert_integrity(engine)
        assert held(engine) == 0


def test_a_frozen_generation_nobody_takes_is_dropped_and_its_pages_freed(monkeypatch):
    outputs = {}
    src = running_source(4, outputs)
    monkeypatch.setattr(move_out, "LEASE_S", 0.05)
    src.role.moves.freeze(src.scheduler.find("g"), "rebalance")
    src.step()
    assert held(src) > 0 and src.role.moves.frozen
    time.sleep(0.1)
    src.step()
    assert not src.role.moves.frozen and held(src) == 0
    assert_integrity(src)


def test_an_abort_drops_a_frozen_generation():
    outputs = {}
    src = running_source(4, outputs)
    src.role.moves.freeze(src.scheduler.find("g"), "drain")
    src.step()
    assert src.abort("g") and held(src) == 0 and not src.role.moves.frozen
    with pytest.raises(LookupError):
        src.role.moves.frozen_for("g", [])
    assert_integrity(src)


def test_the_caller_must_continue_from_the_frozen_tokens():
    outputs = {}
    src = running_source(4, outputs)
    src.role.moves.freeze(src.scheduler.find("g"), "drain")
    src.step()
    sent = tokens_of(outputs, "g")
    with pytest.raises(ValueError, match="froze here at"):
        src.role.moves.frozen_for("g", list(range(10, 17)) + sent[:-1])


def n2_engine(outputs: dict):
    engine = make_engine(page_size=4, role=Role.DECODE)
    engine.add_request(make_req("n2", list(range(10, 17)), outputs, max_new_tokens=6, n=2))
    engine.step()
    engine.role.kv_ready("n2", [FirstToken(17), FirstToken(17)], 0)
    return engine


def test_n_above_one_is_refused_a_rebalance_and_goes_on_here():
    outputs = {}
    engine = n2_engine(outputs)
    marked, refused = engine.role.moves.freeze(engine.scheduler.find("n2")[:1], "rebalance")
    assert marked == [] and refused and "n > 1" in refused[0]
    run_until_idle(engine)
    assert tokens_of(outputs, "n2", 1) == list(range(17, 23))
    assert held(engine) == 0


def test_n_above_one_ends_at_once_when_the_worker_drains():
    """The drain does not wait it out: both choices end with an error the gateway continues by recomputation."""
    outputs = {}
    engine = n2_engine(outputs)
    marked, refused = engine.role.moves.freeze(engine.scheduler.find("n2")[:1], "drain")
    assert marked == [] and "n > 1" in refused[0]
    for index in (0, 1):
        last = outputs[("n2", index)][-1]
        assert last.finish_reason == "abort" and "recomputation" in last.error
    assert not engine.has_work() and held(engine) == 0
    assert_integrity(engine)


def test_every_choice_of_n_above_one_is_named_once():
    outputs = {}
    engine = n2_engine(outputs)
    _, refused = engine.role.moves.freeze(engine.scheduler.find("n2"), "rebalance")
    assert len(refused) == 1
