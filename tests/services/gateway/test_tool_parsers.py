"""Tool-call parsers: every parser gives the same calls and content whether the output comes whole or streamed
in any chunking, argument fragments stream as they come, and what the output names is read, never run."""
from __future__ import annotations

import json
import random

import pytest

from pdserve.services.gateway.intake.tool_calls import CallStream
from pdserve.services.gateway.intake.tool_parsers import (PARSERS, NamedCallOutput, PythonicParser, RequiredCallsOutput,
                                                   get_parser)


def read(reader, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """(content, [(name, arguments)], every tool-call delta) from feeding `pieces` to a CallStream."""
    stream = CallStream(reader)
    content, deltas = "", []
    for k, piece in enumerate(pieces + [""]):
        new, calls = stream.push(piece, final=k == len(pieces))
        content += new
        deltas += calls
    found: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(found) and d["id"].startswith("call_") and d["type"] == "function"
            found[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        found[d["index"]][1] += d["function"].get("arguments", "")
    calls = [tuple(v) for v in found.values()]
    assert stream.message_content() == (content or (None if calls else ""))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in stream.message_calls() or []] == calls
    return content, calls, deltas


def chunkings(text: str) -> list[list[str]]:
    """The whole text, every fixed chunk size up to 7, and random cuts (boundaries land inside the markup)."""
    out = [[text]] + [[text[i:i + n] for i in range(0, len(text), n)] for n in range(1, 8)]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


QWEN_TWO = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "set_alarm", "arguments": {"hours": 7}}\n'
            '</tool_call>')
PARSER_CASES = [
    ("qwen25", QWEN_TWO, "Let me check both.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("set_alarm", {"hours": 7})]),
    ("qwen", '<tool_call>\n{"name": "f", "arguments": {"s": "a \\"quoted\\" }</tool_call> and \\u00e9"}}\n'
             '</tool_call>', "", [("f", {"s": 'a "quoted" }</tool_call> and é'})]),
    ("qwen25", 'No tools needed: 2 < 3 and <b>bold</b>.', 'No tools needed: 2 < 3 and <b>bold</b>.', []),
    ("qwen25", 'Text <tool_call>not json</tool_call> more', 'Text <tool_call>not json</tool_call> more', []),
    ("qwen25", '<tool_call>{"arguments": {"x": [1, {"y": "}"}]}, "name": "g"}</tool_call>\n\nDone.', "\n\nDone.",
     [("g", {"x": [1, {"y": "}"}]})]),
    ("qwen25", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
               '{"name": "set_alarm", "parameters": {"hours": 7}}', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("set_alarm", {"hours": 7})]),
    ("llama3", '{"name": "set_alarm", "parameters": {"hours": 7}}', "", [("set_alarm", {"hours": 7})]),
    ("llama3", 'I will look.<|python_tag|>{"name": "f", "arguments": {}}', "I will look.", [("f", {})]),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", 'Paris is sunny {mostly}.', 'Paris is sunny {mostly}.', []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), set_alarm(hours=7)]', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("set_alarm", {"hours": 7})]),
    ("pythonic", "Sure. [f(a='x, y]', b=[1, 2.5, None], c={'k': True}, d=-3)] Done.", "Sure. Done.",
     [("f", {"a": "x, y]", "b": [1, 2.5, None], "c": {"k": True}, "d": -3})]),
    ("pythonic", 'A list [1, 2] and [see(this)] stay text.', 'A list [1, 2] and [see(this)] stay text.', []),
]


@pytest.mark.parametrize("parser, text, content, calls", PARSER_CASES)
def test_parsers_give_the_same_calls_whole_and_streamed_in_any_chunks(parser, text, content, calls):
    for pieces in chunkings(text):
        got_content, got_calls, _ = read(get_parser(parser), pieces)
        assert got_content == content, pieces
        stream, shown = CallStream(get_parser(parser)), ""
        for piece in pieces:  # nothing shown is taken back: no piece of markup ever reaches the content
            shown += stream.push(piece)[0]
            assert content.startswith(shown), (pieces, shown)
        assert [(name, json.loads(args)) for name, args in got_calls] == calls, pieces


FRAGMENTS = ["<tool_call>", "</tool_call>", "<|python_tag|>", '{"name": "f", ', '"arguments": ', '"parameters": ',
             '{"a": [1, "}"]}', "}", "{", "]", "[", '"', "\\", ";", ",", " ", "\n", "text", "g(x=1)", "h(", ")",
             "[k(y='a')]", "<tool_", "<|python"]


@pytest.mark.parametrize("parser", sorted(PARSERS) + ["named", "required"])
def test_scans_only_grow_on_any_output(parser):
    """Whatever a model writes, what was shown stays true: content and each call's arguments only grow."""
    rng = random.Random(parser)
    reader = {"named": NamedCallOutput("f"), "required": RequiredCallsOutput()}.get(parser) or get_parser(parser)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        before = reader.scan("", False)
        for k in range(1, len(text) + 2):
            scan = reader.scan(text[:k], k > len(text))
            assert scan.content.startswith(before.content), (text, k)
            named = [c for c in scan.calls if c.name is not None]
            for old, new in zip([c for c in before.calls if c.name is not None], named):
                assert new.name == old.name and new.arguments.startswith(old.arguments), (text, k)
            assert len(named) >= sum(c.name is not None for c in before.calls), (text, k)
            before = scan


def test_arguments_stream_as_fragments_and_text_before_the_call_first():
    text = QWEN_TWO
    stream = CallStream(get_parser("qwen25"))
    events = []
    for ch in text:
        content, calls = stream.push(ch)
        events += [("content", content)] * bool(content) + [("call", c) for c in calls]
    first_call = next(i for i, e in enumerate(events) if e[0] == "call")
    assert all(kind == "content" for kind, _ in events[:first_call])
    assert "".join(c for kind, c in events if kind == "content") == "Let me check both."
    fragments = [c for kind, c in events if kind == "call" and c["index"] == 0]
    assert len(fragments) > 5  # arguments arrive as they are generated, not at the end
    assert fragments[0]["function"]["name"] == "get_weather"
    # held back, never shown: a tag still arriving
    stream = CallStream(get_parser("qwen25"))
    assert stream.push("Checking <tool_") == ("Checking", [])


def test_parallel_tool_calls_false_keeps_the_first_call_and_drops_the_markup_of_the_rest():
    content, calls, _ = read(CallStream(get_parser("qwen25")).reader, [QWEN_TWO])
    assert len(calls) == 2
    stream = CallStream(get_parser("qwen25"), max_calls=1)
    new, deltas = stream.push(QWEN_TWO, final=True)
    assert new == "Let me check both." and {d["index"] for d in deltas} == {0}
    assert [c["function"]["name"] for c in stream.message_calls()] == ["get_weather"]


def test_pythonic_values_are_read_never_run(tmp_path):
    marker = tmp_path / "ran"
    text = f'[f(x=__import__("os").system("touch {marker}")), g(y=open("{marker}", "w"))]'
    content, calls, _ = read(PythonicParser(), [text])
    assert calls == [] and content == text and not marker.exists()
    assert read(PythonicParser(), ["[f(x=1+2j), g(y={1, 2})]"])[1] == []  # not JSON values


def test_grammar_outputs_are_read_directly():
    for pieces in chunkings('{"city": "Paris", "unit": "celsius"}'):
        assert read(NamedCallOutput("get_weather"), pieces)[1] == \
            [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    text = '[{"name": "get_weather", "parameters": {"city": "Tokyo", "unit": "celsius"}}, ' \
           '{"name": "set_alarm", "parameters": {"hours": 6}}]'
    for pieces in chunkings(text):
        assert read(RequiredCallsOutput(), pieces)[1] == \
            [("get_weather", '{"city": "Tokyo", "unit": "celsius"}'), ("set_alarm", '{"hours": 6}')]


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="unknown tool-call parser 'hermes2'.*llama3.*pythonic.*qwen25"):
        get_parser("hermes2")
    assert {"qwen25", "qwen", "llama3", "pythonic"} <= set(PARSERS)
