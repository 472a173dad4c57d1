"""Splitting a reasoning model's output into `reasoning_content` and `content`, incrementally.

One `ReasoningSplitter` per choice. Text between the parser's start and end tags (`<think>` and `</think>`;
Kimi's `◁think▷` and `◁/think▷`) is reasoning; what follows is content. Parsers differ in where reasoning
starts: `deepseek-r1` models begin inside the reasoning (the template already opened it), `qwen3` and `kimi`
models reason only when their output opens with the start tag. A tag split across pieces is held back until
it is complete, so no piece of a tag is ever shown.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    forced: bool  # the output starts inside the reasoning, its start tag already in the prompt


PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", forced=True),
    "qwen3": ReasoningFormat("<think>", "</think>", forced=False),
    "qwen3-thinking": ReasoningFormat("<think>", "</think>", forced=True),
    "kimi": ReasoningFormat("\u25c1think\u25b7", "\u25c1/think\u25b7", forced=False),
}


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose one of {', '.join(PARSERS)}")
        self.format = PARSERS[parser]
        self.forced = self.format.forced
        self.state = "start"  # start -> reasoning -> content, or start -> content
        self.buf = ""
        self.strip_content = False  # drop whitespace between </think> and the answer

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning" or (self.state == "start" and self.forced)

    def push(self, piece: str, final: bool = False) -> Split:
        """The reasoning and content of `piece`, as far as they are known; `final`: the output ends with it, and
        what was held back (a possible tag) goes to the part we are in."""
        out = self._push(piece)
        if final:
            rest = self.flush()
            out.reasoning += rest.reasoning
            out.content += rest.content
        return out

    def _push(self, piece: str) -> Split:
        self.buf += piece
        out = Split()
        if self.state == "start":
            head, start = self.buf.lstrip(), self.format.start
            if head.startswith(start):
                self.buf, self.state = head[len(start):], "reasoning"
            elif start.startswith(head):
                return out  # might still become the opening tag
            else:
                self.state = "reasoning" if self.forced else "content"
        if self.state == "reasoning":
            end = self.format.end
            pos = self.buf.find(end)
            if pos < 0:
                keep = _partial_suffix(self.buf, end)
                out.reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.reasoning, self.buf = self.buf[:pos], self.buf[pos + len(end):]
            self.state, self.strip_content = "content", True
        if self.strip_content:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return out
            self.strip_content = False
        out.content, self.buf = self.buf, ""
        return out

    def flush(self) -> Split:
        """The output ended: what was held back belongs to the part we are in."""
        rest, self.buf = self.buf, ""
        if self.state == "content":
            return Split(content="" if self.strip_content else rest)
        if self.in_reasoning:
            return Split(reasoning=rest)
        return Split(content=rest)


def split_text(parser: str, text: str) -> Split:
    """The whole output at once (non-streaming responses)."""
    return ReasoningSplitter(parser).push(text, final=True)


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
