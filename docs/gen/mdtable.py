"""Small helpers the reference generators share: text from the code made safe inside a Markdown table."""
from __future__ import annotations

import html

_ESCAPED = str.maketrans({"|": "\\|", "*": "\\*", "_": "\\_", "[": "\\[", "]": "\\]", "`": "\\`", "\\": "\\\\"})


def text(value: str) -> str:
    """Prose from the code (help strings, docstrings) as one table cell: no markup, no line breaks."""
    return html.escape(" ".join(value.split()), quote=False).translate(_ESCAPED)


def code(value: object) -> str:
    """A value in a code span of one table cell (backticks doubled around a value that holds one)."""
    shown = " ".join(str(value).split())  # a pipe inside a code span does not split the table's cell
    if not shown:
        return ""
    fence = "``" if "`" in shown else "`"
    return f"{fence} {shown} {fence}" if fence == "``" else f"`{shown}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
