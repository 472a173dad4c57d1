"""The gateway's cost of stop_regex per piece of text: StopMatcher over 4,000 one-word pieces (the detokenizer's
output of a 4,000-token answer that never matches), for no pattern (a stop string instead), one pattern, an
unbounded one (searched back the whole window) and the most a request may give (16).

    .venv/bin/python benchmarks/bench_stop_regex.py [--pieces 4000]

The baseline in the same run is a stop string. What matters is the per-piece time against a decode step
(13-40 ms on this CPU): it is spent on the gateway's event loop, once per token of every stream.
"""
from __future__ import annotations

import argparse
import random
import time

from pdserve.services.gateway.workers.stops import StopMatcher

CASES = [("stop string 'STOP'", ["STOP"], []), ("one regex 'and|or'", [], ["and|or"]),
         (r"one regex '\b(and|or)\b'", [], [r"\b(and|or)\b"]), ("unbounded '<.*>'", [], ["<.*>"]),
         (r"16 x '\d{6}'", [], [r"\d{6}"] * 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=4000)
    args = parser.parse_args()
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "quickly"]
    pieces = [" " + rng.choice(words) for _ in range(args.pieces)]
    for name, stops, regexes in CASES:
        best = float("inf")
        for _ in range(3):
            matcher = StopMatcher(stops, regexes=regexes)
            start = time.perf_counter()
            for piece in pieces:
                matcher.push(piece)
            best = min(best, (time.perf_counter() - start) / len(pieces))
        print(f"{name:28s} {best * 1e6:8.1f} us/piece")


if __name__ == "__main__":
    main()
