"""A weight update over several gateway processes when one of them does not answer (a unit test of the update's
logic over a stand-in for the other processes): those that were held are released at once, and the update
changes nothing, instead of leaving doors closed for HOLD_LIMIT_S."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.services.gateway.workers.backend import Door
from pdserve.services.gateway.apis.admin.weights import SiblingSilent, UpdateGate, _held_everywhere, _running_after


class Silent:
    """Other processes: `fails` does not answer (a timeout); every call is recorded."""

    def __init__(self, fails: str) -> None:
        self.fails, self.calls = fails, []

    async def tell(self, name: str, body: dict, timeout_s: float) -> list[dict]:
        self.calls.append(name)
        if name == self.fails:
            raise TimeoutError()
        return [{"in_flight": 0}]


async def test_a_process_that_misses_the_hold_gets_the_others_released_and_nothing_changes():
    siblings = Silent("weights_hold")
    gate, gw = UpdateGate(Door(), siblings), SimpleNamespace(model_path="/old")
    with pytest.raises(SiblingSilent, match="did not answer"):
        async with _held_everywhere(gw, gate):
            raise AssertionError("the update went on without every process held")
    assert siblings.calls == ["weights_hold", "weights_release"] and gate.committed is None


async def test_a_process_that_misses_the_drain_question_stops_the_update_before_any_commit():
    gate = UpdateGate(Door(), Silent("weights_drained"))
    with pytest.raises(SiblingSilent):
        await _running_after(gate, 0.1)
