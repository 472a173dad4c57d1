"""Stop strings over a stream of text pieces.

`StopMatcher` owns the text of one choice that has been produced but not yet released. It releases text
only when no stop string can start inside it, so the beginning of a stop string never reaches a client,
however the text is split into pieces. When a stop string appears, the text before it is released and the
choice is over.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopResult:
    text: str  # text that may be shown now
    matched: str | None = None  # the stop string found (the choice ends), else None


class StopMatcher:
    def __init__(self, stops: list[str], keep_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.keep_stop = keep_stop  # SGLang's no_stop_trim: show the stop string itself
        self.held = ""
        self.done = False

    def push(self, piece: str) -> StopResult:
        if self.done:
            return StopResult("")
        if not self.stops:
            return StopResult(piece)
        text = self.held + piece
        found = self._earliest(text)
        if found is not None:
            pos, stop = found
            self.held, self.done = "", True
            return StopResult(text[:pos + len(stop)] if self.keep_stop else text[:pos], stop)
        keep = self._longest_partial(text)
        self.held = text[len(text) - keep:] if keep else ""
        return StopResult(text[:len(text) - keep])

    def flush(self) -> str:
        """The choice ended for another reason: release what was held back (it is not a stop string)."""
        held, self.held = self.held, ""
        return "" if self.done else held

    def _earliest(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = text.find(stop)
            if pos >= 0 and (best is None or pos < best[0] or (pos == best[0] and len(stop) > len(best[1]))):
                best = (pos, stop)
        return best

    def _longest_partial(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
