"""The flight recorder's bookkeeping (services/gateway/timelines.py): the most recent requests in order, the
slowest ones whatever came after them, and a request found by any of its ids."""
from __future__ import annotations

from pdserve.services.gateway.timelines import FlightRecorder, Timeline


def timeline(n: int, total_s: float) -> Timeline:
    return Timeline(f"req-{n}", f"rid-{n}", f"client-{n}", f"{n:032x}", started=1000.0 + n, total_s=total_s)


def test_recent_ones_in_order_and_the_slowest_kept_past_them():
    recorder = FlightRecorder(recent=3, slowest=2)
    for n, total in enumerate([5.0, 0.1, 9.0, 0.2, 0.3, 0.1]):
        recorder.record(timeline(n, total))
    assert [t.request_id for t in recorder.recent] == ["req-3", "req-4", "req-5"]
    assert [t.request_id for t in recorder.slowest] == ["req-2", "req-0"]  # slowest first, long gone from recent


def test_a_request_is_found_by_any_of_its_ids_once():
    recorder = FlightRecorder(recent=4, slowest=4)
    for n in range(3):
        recorder.record(timeline(n, 1.0 + n))  # each is both recent and among the slowest
    for wanted in ("req-1", "rid-1", "client-1", f"{1:032x}"):
        assert [t.rid for t in recorder.find(wanted)] == ["rid-1"]
    assert recorder.find("nobody") == []
