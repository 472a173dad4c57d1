"""Stop strings and stop regexes over a stream of text pieces.

`StopMatcher` owns the text of one choice that has been produced but not yet released. It releases text
only when no stop string can start inside it, so the beginning of a stop string never reaches a client,
however the text is split into pieces. When a stop string appears, the text before it is released and the
choice is over.

A stop regex (SGLang's stop_regex) ends the choice at the end of its first match, and the matched text stays in
the output, as in SGLang (whose trimming looks for the pattern itself in the text); `matched` is the pattern. Its
work per piece is bounded twice: each search covers only the new piece and, before it, as many characters as a
match of the pattern can span (its width from the parser), at most `REGEX_WINDOW` (an unbounded `a.*b` finds
matches that fit in the window; SGLang searches a tail of the output the same way, but unbounded patterns
there reread the whole output at every token); and it runs under `REGEX_TIMEOUT_S`, since a short pattern can
still backtrack exponentially in a short text (`(a|aa)+$`). A search that runs out of time ends the request with
a 400 naming the pattern.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from re import _parser as re_parser  # the width of a pattern (what SGLang's stop_regex bound reads too)

import regex

from pdserve.services.gateway.errors import ApiError

REGEX_WINDOW = 1024  # characters of earlier text a regex search reaches back
REGEX_TIMEOUT_S = 0.02  # per search


@dataclass
class StopResult:
    text: str  # text that may be shown now
    matched: str | None = None  # the stop string or stop regex found (the choice ends), else None


@dataclass(frozen=True)
class StopRegex:
    pattern: str
    compiled: regex.Pattern
    reach: int  # characters before a piece that a match ending in it may start at


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> StopRegex:
    """The pattern, checked with Python's re (its syntax and error messages) and compiled for a search with a
    timeout; ValueError for a bad one."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("a stop_regex must be a non-empty string")
    try:
        re.compile(pattern)
        widest = re_parser.parse(pattern).getwidth()[1]
        compiled = regex.compile(pattern, regex.VERSION0)
    except (re.error, regex.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"{pattern!r} is not a valid regular expression: {exc}") from None
    return StopRegex(pattern, compiled, min(widest, REGEX_WINDOW))


class StopMatcher:
    def __init__(self, stops: list[str], keep_stop: bool = False, regexes: list[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.keep_stop = keep_stop  # SGLang's no_stop_trim: show the stop string itself
        self.regexes = [compile_stop_regex(p) for p in regexes]
        self.reach = max((r.reach for r in self.regexes), default=0)
        self.seen = ""  # the last `reach` characters before `held` (regexes only)
        self.held = ""
        self.done = False

    def push(self, piece: str) -> StopResult:
        if self.done:
            return StopResult("")
        if not self.stops and not self.regexes:
            return StopResult(piece)
        text = self.held + piece
        found = self._earliest(text)
        cut = (found[0] + (len(found[1]) if self.keep_stop else 0)) if found is not None else None
        by_regex = self._regex_end(text, len(piece))
        if by_regex is not None and (cut is None or by_regex[0] <= cut):
            cut, found = by_regex[0], (by_regex[0], by_regex[1])
        if found is not None:
            self.held, self.done = "", True
            return StopResult(text[:cut], found[1])
        keep = self._longest_partial(text)
        self.held = text[len(text) - keep:] if keep else ""
        released = text[:len(text) - keep]
        if self.reach:
            self.seen = (self.seen + released)[-self.reach:]
        return StopResult(released)

    def flush(self) -> str:
        """The choice ended for another reason: release what was held back (it is not a stop string)."""
        held, self.held = self.held, ""
        return "" if self.done else held

    def _regex_end(self, text: str, new: int) -> tuple[int, str] | None:
        """(where in `text` the earliest-ending match of a stop regex ends, its pattern), searching the last `new`
        characters of `text` and what a match ending there may reach back to."""
        best: tuple[int, str] | None = None
        window = self.seen + text
        for r in self.regexes:
            start = max(0, len(window) - new - r.reach)
            try:
                m = r.compiled.search(window, start, timeout=REGEX_TIMEOUT_S)
            except TimeoutError:
                raise ApiError(400, f"stop_regex {r.pattern!r} took more than {REGEX_TIMEOUT_S * 1000:g} ms to "
                                    f"search the output; simplify it.", "stop_regex") from None
            if m is not None:
                end = max(m.end() - len(self.seen), 0)
                if best is None or end < best[0]:
                    best = (end, r.pattern)
        return best

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
