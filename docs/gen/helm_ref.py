"""The Helm values table, read from helm/pdserve/values.yaml (its `# --` comments) and values.schema.json.

values.yaml documents a key with a `# -- text` comment above it (the helm-docs convention; lines after it
continue the text). A documented key is one row, its whole value the default, however deep that value is;
every other leaf key is a row of its own (its description then comes from the closest documented or
commented parent section), so that no value of the chart is missing from the table. The type column is the
schema's (its `enum` when it has one).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from mdtable import code, table, text

CHART = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?:\s|$)")


def documented() -> tuple[dict[str, str], dict[str, str]]:
    """(key path -> `# --` text, section path -> its plain comment) from values.yaml's comments."""
    docs: dict[str, str] = {}
    sections: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the mappings the current line is inside
    pending: list[str] = []  # comment lines right above the current line
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = KEY.match(line)
        if not match:
            if not stripped:  # a blank line ends a comment that belongs to no key
                pending = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([key for _, key in stack] + [match["key"]])
        stack.append((indent, match["key"]))
        marked = [i for i, comment in enumerate(pending) if comment.startswith("-- ")]
        if marked:
            docs[path] = " ".join([pending[marked[-1]][3:], *pending[marked[-1] + 1:]])
            before = pending[:marked[-1]]
        else:
            before = pending
        if before:
            sections[path] = " ".join(before)
        pending = []
    return docs, sections


def schema_node(path: str) -> dict | None:
    node = json.loads((CHART / "values.schema.json").read_text())
    for key in path.split("."):
        node = node.get("properties", {}).get(key)
        if node is None:
            return None
    return node


def schema_type(path: str) -> str:
    node = schema_node(path) or {}
    if "enum" in node:
        return " \\| ".join(code(json.dumps(v)) for v in node["enum"])
    kind = node.get("type", "")
    return " \\| ".join(kind) if isinstance(kind, list) else kind


def sections() -> list[tuple[str, str, list[tuple[str, object, str]]]]:
    """(top-level key, its comment, rows) in values.yaml's order; rows are (key path, default, description).

    A mapping is walked into where the schema lists its keys; one it leaves free (`resources`, `nodeSelector`,
    security contexts: Kubernetes' own objects) is one row, its whole value the default.
    """
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    docs, comments = documented()

    def walk(tree: dict, prefix: str) -> list[tuple[str, object, str]]:
        out = []
        for key, value in tree.items():
            path = f"{prefix}{key}"
            node = schema_node(path)
            if path not in docs and isinstance(value, dict) and value and (node is None or "properties" in node):
                out += walk(value, path + ".")
            else:
                out.append((path, value, docs.get(path, "")))
        return out

    top = [(key, value) for key, value in values.items()]
    out = [("General", "", walk({k: v for k, v in top if not _is_section(k, v)}, ""))]
    out += [(key, comments.get(key, ""), walk(value, key + ".")) for key, value in top if _is_section(key, value)]
    return out


def _is_section(key: str, value: object) -> bool:
    node = schema_node(key)
    return isinstance(value, dict) and bool(value) and (node is None or "properties" in node)


def page() -> str:
    lines = ["# Helm values", "",
             "Every value of the chart in `helm/pdserve`, read from its `values.yaml` and `values.schema.json` "
             "when this site is built (the schema refuses a key that is not here, and a value of another type, "
             "before anything renders). Set them with `--set key=value` or `-f my-values.yaml`; the chart's "
             "examples are in `helm/pdserve/ci/`. How the chart deploys pdserve: "
             "[Kubernetes (Helm)](../deploying/helm.md).", ""]
    for title, comment, rows in sections():
        lines += [f"## {title}", ""]
        if comment:
            lines += [text(comment), ""]
        body = [[f'<span id="{path}"></span>{code(path)}', schema_type(path), code(json.dumps(value)), text(doc)]
                for path, value, doc in rows]
        lines += [table(["key", "type", "default", "meaning"], body)]
    return "\n".join(lines)
