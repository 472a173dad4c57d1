"""The flight recorder: where the last requests' time went, without a trace collector.

Each generation that ends leaves a Timeline (its ids, the worker pair, its time to first token in the parts the
workers report, its total time, tokens and what happened on the way: retries, migrations, errors). The recorder
keeps the most recent `RECENT` and the `SLOWEST` by total time, in this gateway process's memory: the status page
shows them (/status.json), `GET /debug/requests/{id}` answers one by any of its ids, and `pdserve debug trace ID`
prints it.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import asdict, dataclass, field

RECENT = 100
SLOWEST = 20


@dataclass
class Timeline:
    request_id: str  # X-Request-Id: what the client and the logs know
    rid: str  # the gateway's id of the generation, as the workers know it
    public_id: str  # the client's id (its `rid`, or the answer's id)
    trace_id: str  # "" without tracing
    started: float  # unix time
    workers: str = ""  # the pair of the last attempt
    ttft_s: float | None = None
    ttft_parts: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # retries, migrations, the error that ended it

    def as_dict(self) -> dict:
        return asdict(self)


class FlightRecorder:
    def __init__(self, recent: int = RECENT, slowest: int = SLOWEST) -> None:
        self.recent: deque[Timeline] = deque(maxlen=recent)
        self._slowest: list[tuple[float, int, Timeline]] = []  # a min-heap on total time
        self._capacity = slowest
        self._order = itertools.count()  # ties in the heap never compare Timelines

    def record(self, timeline: Timeline) -> None:
        self.recent.append(timeline)
        entry = (timeline.total_s, next(self._order), timeline)
        if len(self._slowest) < self._capacity:
            heapq.heappush(self._slowest, entry)
        elif entry[0] > self._slowest[0][0]:
            heapq.heapreplace(self._slowest, entry)

    @property
    def slowest(self) -> list[Timeline]:
        return [t for _, _, t in sorted(self._slowest, key=lambda e: -e[0])]

    def find(self, any_id: str) -> list[Timeline]:
        """Every kept timeline that `any_id` names (a request id may cover several generations: n prompts)."""
        seen: dict[int, Timeline] = {}
        for t in itertools.chain(self.recent, (t for _, _, t in self._slowest)):
            if any_id in (t.request_id, t.rid, t.public_id, t.trace_id):
                seen[id(t)] = t
        return sorted(seen.values(), key=lambda t: t.started)
