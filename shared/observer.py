"""What an engine reports as it steps: running totals (`StepStats`), and hooks at a request's lifecycle
(`RequestObserver`) that a worker's metrics implement."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.shared.req import Req


@dataclass
class StepStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_step_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


class RequestObserver:
    """Hooks at a request's lifecycle, for metrics; called on the engine thread, and doing nothing here.

    Each runs once per request, or once per output message of a request, never per batch: keep them cheap.
    """

    def scheduled(self, req: Req) -> None:
        """The first chunk of `req`'s prompt ran (at `req.first_scheduled`): its queue time is over."""

    def prefilled(self, req: Req) -> None:
        """The KV of `req`'s fresh prompt is complete (`req.cached_tokens` of it came from the prefix cache)."""

    def output(self, req: Req, num_tokens: int, finish_reason: str | None) -> None:
        """`num_tokens` new tokens of `req` (none when it only finishes) are leaving through `on_output`."""
