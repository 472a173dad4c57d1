"""Trace readers: each public format read from a small file, arrivals from 0 and scaled, bad files refused with
the line and field."""
from __future__ import annotations

import pytest

from pdserve.planning.traces import (TraceError, TraceRequest, prompt_ids, read_trace, synthetic, write_azure)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.1000000,879,7
"""
MOONCAKE = """{"timestamp": 0, "input_length": 1100, "output_length": 12, "hash_ids": [0, 1, 2]}
{"timestamp": 250, "input_length": 1030, "output_length": 3, "hash_ids": [0, 1, 7]}

{"timestamp": 1500, "input_length": 10, "output_length": 5, "hash_ids": [9]}
"""
BURST = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,1028,1445,API log
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_csv_sorted_from_zero(tmp_path):
    trace = read_trace(write(tmp_path, "a.csv", AZURE))
    assert trace.format == "azure"
    assert [(r.input_len, r.output_len) for r in trace.requests] == [(374, 44), (879, 7), (396, 109)]
    assert [round(r.arrival_s, 4) for r in trace.requests] == [0.0, 0.4194, 4.3146]


def test_mooncake_jsonl_keeps_hash_ids_and_ms(tmp_path):
    trace = read_trace(write(tmp_path, "m.jsonl", MOONCAKE), time_scale=2.0)
    assert trace.format == "mooncake"
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 3.0]
    assert trace.requests[1].hash_ids == (0, 1, 7)
    first, second = (prompt_ids(r, i) for i, r in enumerate(trace.requests[:2]))
    assert len(first) == 1100 and len(second) == 1030
    assert first[:1024] == second[:1024] and first[1024:1030] != second[1024:1030]


def test_burstgpt_csv_leaves_failed_rows_out(tmp_path):
    trace = read_trace(write(tmp_path, "b.csv", BURST))
    assert trace.format == "burstgpt" and trace.skipped == 1
    assert [(r.arrival_s, r.input_len, r.output_len) for r in trace.requests] == [(0.0, 472, 18), (113.0, 417, 1028)]


@pytest.mark.parametrize("name, text, message", [
    ("a.csv", AZURE.replace("396,109", "396,lots"), "line 3: GeneratedTokens must be a whole number, got 'lots'"),
    ("a.csv", AZURE.replace("2023-11-16 18:15:50.9951690", "yesterday"), "line 3: TIMESTAMP must be a date-time"),
    ("a.csv", "TIMESTAMP,ContextTokens\n1,2\n", "line 1: not a known trace format"),
    ("a.csv", AZURE + "2023-11-16 18:16:00,5\n", "line 5: 2 fields, the header has 3"),
    ("m.jsonl", MOONCAKE.replace('"output_length": 3, ', ""), "line 2: missing field 'output_length'"),
    ("m.jsonl", MOONCAKE.replace('"timestamp": 250', '"timestamp": "soon"'), "line 2: timestamp must be a number"),
    ("m.jsonl", MOONCAKE.replace('[9]', '[9, 10]'), "line 4: 2 hash_ids of 512 tokens are more than input_length 10"),
    ("m.jsonl", MOONCAKE.replace("}\n{", "\n{", 1), "line 1: not JSON"),
    ("b.csv", BURST.replace("472,18", "-4,18"), "line 2: Request tokens must be >= 0, got -4"),
    ("e.csv", "", "not a known trace format"),
])
def test_malformed_files_name_line_and_field(tmp_path, name, text, message):
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(write(tmp_path, name, text))


def test_a_missing_file_and_a_bad_scale_are_refused(tmp_path):
    with pytest.raises(TraceError, match="cannot read it"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="time scale must be > 0"):
        read_trace(write(tmp_path, "a.csv", AZURE), time_scale=0)


def test_a_synthetic_trace_round_trips_through_the_azure_format(tmp_path):
    requests = synthetic(rate=1.2, duration_s=100, seed=3)
    assert 80 < len(requests) < 160  # Poisson at 1.2/s over 100 s
    path = tmp_path / "s.csv"
    write_azure(path, requests)
    trace = read_trace(path)
    assert [(r.input_len, r.output_len) for r in trace.requests] == [(r.input_len, r.output_len) for r in requests]
    offset = requests[0].arrival_s
    assert all(abs(a.arrival_s - (b.arrival_s - offset)) < 1e-5 for a, b in zip(trace.requests, requests))
    assert prompt_ids(TraceRequest(0, 7, 1), 1) != prompt_ids(TraceRequest(0, 7, 1), 2)
