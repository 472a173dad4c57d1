"""The arms of a comparison, measured so that the order cannot flatter one of them on a machine that drifts.

Every round runs each arm once, in its own process (the caller's part), in an order that rotates from round to
round: AB, BA, AB, ... for two arms, ABC, BCA, CAB, ... for three, so that no arm is always the first or the
last of its round. Figures are reported as the median over the rounds with their spread (lowest-highest), and
each arm against the baseline two ways: the quotient of the medians, and the range of the per-round quotients
(each taken from two measurements next to each other in time, which a slow drift of the machine moves alike).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


def order(arms: Sequence[T], round_index: int) -> list[T]:
    """The arms in the order round `round_index` (from 0) runs them."""
    shift = round_index % len(arms)
    return [*arms[shift:], *arms[:shift]]


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values to summarise")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, fmt: str = ".2f") -> str:
        """'12.30 (11.90-13.10)'; a single value alone."""
        if self.n == 1:
            return format(self.median, fmt)
        return f"{self.median:{fmt}} ({self.low:{fmt}}-{self.high:{fmt}})"

    def as_dict(self) -> dict:
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.n}


@dataclass(frozen=True)
class Ratio:
    """`arm / base`: of the medians, and the spread of the per-round quotients."""

    of_medians: float
    rounds: Spread

    @classmethod
    def of(cls, arm: Sequence[float], base: Sequence[float]) -> Ratio:
        if len(arm) != len(base):
            raise ValueError(f"{len(arm)} rounds of the arm against {len(base)} of the baseline")
        return cls(statistics.median(arm) / statistics.median(base), Spread.of([a / b for a, b in zip(arm, base)]))

    def text(self) -> str:
        if self.rounds.n == 1:
            return f"{self.of_medians:.3f}"
        return f"{self.of_medians:.3f} (rounds {self.rounds.low:.3f}-{self.rounds.high:.3f})"

    def as_dict(self) -> dict:
        return {"of_medians": self.of_medians, "rounds": self.rounds.as_dict()}
