"""The `pdserve bench` client: streaming load against any OpenAI-compatible server, and its statistics.

It speaks only HTTP to the server and imports nothing else of pdserve, so it measures any server alike.
`cli.py` is the command; `load.py` sends the requests and times their streams (`messages.py` and
`responses.py` read the other dialects' streams as chat chunks); `chain.py` runs chained conversations;
`report.py` turns results into statistics and tables, `plot.py` into a PNG. The names below are what the
benchmark scripts and tests import, in one place.
"""
from __future__ import annotations

from pdserve.benchclient.cli import parse_concurrencies, report
from pdserve.benchclient.load import (APIS, ErrorReporter, Load, StreamTally, Target, arrival_offsets, chat_body,
                                      fetch_model, make_prompts, requests_for, run_level, run_sweep, stream_chat)
from pdserve.benchclient.report import (LevelSummary, RequestResult, format_errors, format_table, percentile,
                                        redact, summarize)

__all__ = [
    "APIS", "ErrorReporter", "LevelSummary", "Load", "RequestResult", "StreamTally", "Target", "arrival_offsets",
    "chat_body", "fetch_model", "format_errors", "format_table", "make_prompts", "parse_concurrencies",
    "percentile", "redact", "report", "requests_for", "run_level", "run_sweep", "stream_chat", "summarize",
]
