"""A worker's periodic stats line: logged only while it works, with its load, KV use and throughput."""
from __future__ import annotations

import asyncio
import logging

from pdserve.services.worker.front.app import StatsLine
from pdserve.services.worker.channel.messages import StatsSample
from pdserve.shared.observer import StepStats


class Engine:
    """What StatsLine reads of the engine process (engine_calls.call_stats_sample: load, token totals and the
    speculator's figures), through the link's call()."""

    def __init__(self) -> None:
        self.stats = StepStats()
        self.running = self.waiting = 0
        self.speculator = None

    def load(self) -> dict[str, int]:
        return {"running": self.running, "waiting": self.waiting, "free_pages": 75, "total_pages": 100,
                "cached_pages": 0}

    async def call(self, call: StatsSample, timeout: float):
        assert isinstance(call, StatsSample)
        spec = self.speculator
        return (self.load(), self.stats.prefill_tokens, self.stats.decode_tokens,
                spec.figures() if spec is not None else None)


async def test_the_stats_line_comes_while_the_worker_works_and_not_when_idle(caplog):
    caplog.set_level(logging.INFO, "pdserve.worker")
    engine = Engine()
    line = StatsLine(engine, 10.0)
    await line.tick()
    assert not caplog.records  # idle: nothing to say
    engine.running, engine.waiting = 2, 1
    engine.stats.prefill_tokens, engine.stats.decode_tokens = 40, 10
    await asyncio.sleep(0.1)
    await line.tick()
    busy = caplog.records[-1]
    assert busy.getMessage().startswith("#running-req: 2, #queue-req: 1, token usage: 0.25, prefill throughput")
    assert (busy.running, busy.queued, busy.token_usage) == (2, 1, 0.25)
    assert 0 < busy.gen_throughput <= 100 and 0 < busy.prefill_throughput <= 400  # tokens over >= 0.1 s
    engine.running = engine.waiting = 0
    engine.stats.decode_tokens = 20  # finished since: one more line counts its last tokens
    await line.tick()
    assert caplog.records[-1].gen_throughput > 0 and caplog.records[-1].prefill_throughput == 0
    count = len(caplog.records)
    await line.tick()
    assert len(caplog.records) == count == 2  # idle again: silent


async def test_a_busy_engine_that_does_not_answer_in_time_skips_a_line(caplog):
    class Stuck(Engine):
        async def call(self, call: StatsSample, timeout: float):
            await asyncio.sleep(timeout)  # the step is long: the sample does not come in time
            raise asyncio.TimeoutError

    line = StatsLine(Stuck(), 0.05)
    await line.tick()
    assert not caplog.records


class Speculator:
    def figures(self) -> tuple[float, float]:
        return 3.456, 0.61


async def test_a_speculating_worker_adds_its_accept_length_and_rate(caplog):
    caplog.set_level(logging.INFO, "pdserve.worker")
    engine = Engine()
    engine.speculator = Speculator()
    engine.running = 1
    engine.stats.decode_tokens = 30
    line = StatsLine(engine, 10.0)
    await line.tick()
    record = caplog.records[-1]
    assert record.getMessage().endswith("accept len: 3.46, accept rate: 0.61")
    assert (record.accept_length, record.accept_rate) == (3.46, 0.61)
