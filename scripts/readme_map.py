"""Where each part of the long README went in docs/: the map, the move, and the check that nothing was dropped.

README.md once held the whole manual. MAP names, for each of its headings, the docs page that took its text;
SPLITS send the paragraphs of a section from a given first words onward to another page. Run from the repository:

    python scripts/readme_map.py            # every heading of that README and where it went, with how much of its
                                            # text the page holds verbatim; exit 1 when a part is missing
    python scripts/readme_map.py --move     # append each part of that README to its page (done once, when the
                                            # README was cut to its summary)

Both read the README as it was before the cut (`git show BEFORE:README.md`); --readme FILE reads another.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BEFORE = "ac32bdc10192811338eff453cdca72a875816aa1"  # the last commit whose README.md held the whole manual
COVERED = 0.9  # share of a part's lines a page must hold verbatim (the rest: links and wording fixed on the way)
KEPT = "README.md"  # a part the short README keeps as it is

# Heading path (titles from `## ...` down, joined by " / "; the text above the first `##` is "pdserve") -> the
# page that took it, and the heading it has there ("": its own title; None: none, its text continues the page).
MAP: dict[str, tuple[str, str | None]] = {
    "pdserve": (KEPT, None),
    "Architecture": ("design.md", None),
    "Running it": ("deploying/index.md", None),
    "Running it / Supported models": ("features/models.md", None),
    "Running it / One machine: `pdserve up`": ("deploying/one-machine.md", None),
    "Running it / The services and their flags": ("deploying/services.md", None),
    "Running it / Docker Compose": ("deploying/compose.md", None),
    "Running it / Kubernetes (Helm)": ("deploying/helm.md", None),
    "Running it / SGLang's names, lengths and errors": ("apis/native.md", ""),
    "Running it / Anthropic's Messages API": ("apis/messages.md", None),
    "Running it / Stop regexes, logprobs of chosen token ids, scoring a prompt": ("apis/native.md", ""),
    "Running it / Structured output and tool calls": ("features/structured-output.md", None),
    "Running it / The Responses API": ("apis/responses.md", None),
    "Running it / Input limits and the API document": ("operating/limits.md", None),
    "Running it / Overload and stopping": ("operating/overload.md", None),
    "Running it / Several gateway processes (`--gateway-workers N`)": ("deploying/gateway-workers.md", None),
    "Running it / Reliability: what one hostile request costs": ("operating/hardening.md", None),
    "Running it / Files and Batches at scale": ("apis/files-batches.md", ""),
    "Running it / Internal traffic: the cluster token": ("operating/security.md", ""),
    "Running it / Several tenants on one deployment": ("operating/security.md", ""),
    "Running it / LoRA adapters": ("features/lora.md", None),
    "Running it / Deterministic mode and fp32 logits": ("features/deterministic.md", None),
    "Running it / Speculative decoding": ("features/speculative-decoding.md", None),
    "Running it / KV cache tiers": ("features/kv-tiers.md", None),
    "Running it / Tensor parallelism (`--tp-size`)": ("features/tensor-parallelism.md", None),
    "Running it / Tensor parallelism (`--tp-size`) / A worker across nodes": ("deploying/several-nodes.md", None),
    "Running it / Metrics": ("operating/metrics.md", None),
    "Running it / Traces: where one request's time went": ("operating/traces.md", None),
    "Running it / Logs and request ids": ("operating/logs.md", None),
    "Running it / Troubleshooting": ("operating/troubleshooting.md", None),
    "Performance": ("performance/index.md", None),
    "Performance / Tensor parallelism on this CPU": ("performance/tensor-parallelism.md", None),
    "Performance / Speculative decoding": ("performance/speculative-decoding.md", None),
    "Performance / Int8 decoders (`--quantization w8a8_int8`)": ("performance/runtime.md", ""),
    "Performance / Native kernels on AVX2-only CPUs": ("performance/runtime.md", ""),
    "Performance / GPU": ("performance/gpu.md", None),
}

# Heading path -> (first words of a paragraph, the page its text goes to from there on, its heading there).
SPLITS: dict[str, list[tuple[str, str, str | None]]] = {
    "pdserve": [("Both commands install what they need", "getting-started.md", None),
                ("pdserve is an LLM server", KEPT, None)],
    "Architecture": [("| Layout |", "contributing.md", "How the code is laid out")],
    "Running it": [("The gateway's status page", "operating/status-page.md", None)],
    "Running it / Supported models": [
        ("`--quantization w8a8_int8`", "features/quantization.md", None),
        ("MoE models record", "features/models.md", "Expert distribution"),
        ("`POST /update_weights_from_disk", "features/weight-updates.md", None)],
    "Running it / The Responses API": [
        ("Benchmark (`pdserve bench --api", "performance/serving.md", "The Responses and Messages APIs"),
        ("Refused with a 400 naming the field", "apis/responses.md", None)],
    "Running it / Overload and stopping": [("A stream whose worker dies mid-answer", "features/migration.md", None)],
    "Performance": [
        ("**Structure without a cost**", "performance/serving.md", None),
        ("**Runtime vs transformers", "performance/runtime.md", None)],
    "Performance / Native kernels on AVX2-only CPUs": [
        ("**On a GPU**", "performance/gpu.md", None),
        ("**KV transfer**", "performance/services.md", None),
        ("**Structured output**", "performance/features.md", None)],
}


# A section the README named in quotes ("see \"Overload and stopping\" below") -> where it is now: a link there.
LINKS = {
    "Int8 decoders": "performance/runtime.md#int8-decoders-quantization-w8a8_int8",
    "Overload and stopping": "operating/overload.md",
    "Speculative decoding": "features/speculative-decoding.md",
    "Admin routes": "operating/security.md#admin-routes",
    "Several gateway processes": "deploying/gateway-workers.md",
    "SGLang's names, lengths and errors": "apis/native.md#sglangs-names-lengths-and-errors",
    "A worker across nodes": "deploying/several-nodes.md",
    "Deterministic mode and fp32 logits": "features/deterministic.md",
    "Wide matmuls": "performance/runtime.md",
    "Tensor parallelism on this CPU": "performance/tensor-parallelism.md",
}


@dataclass
class Part:
    key: str  # heading path
    title: str  # its own heading's text
    lines: list[str]
    page: str
    heading: str | None  # its heading on the page ("" its own title; None: none)


def sections(text: str) -> list[tuple[str, str, list[str]]]:
    """(heading path, title, body lines) for the text under each heading, fenced code never read as one."""
    out: list[tuple[str, str, list[str]]] = [("pdserve", "pdserve", [])]
    path: list[tuple[int, str]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"^(#{2,6}) (.+)$", line)
        if match:
            level = len(match[1])
            path = [(lv, t) for lv, t in path if lv < level] + [(level, match[2].strip())]
            out.append((" / ".join(t for _, t in path), match[2].strip(), []))
        elif not (line.startswith("# ") and not fenced and len(out) == 1 and not out[0][2]):
            out[-1][2].append(line)
    return out


def parts(text: str) -> list[Part]:
    found = []
    for key, title, lines in sections(text):
        if key not in MAP:
            raise SystemExit(f"readme_map: README heading {key!r} has no page in MAP")
        page, heading = MAP[key]
        current = Part(key, title, [], page, heading)
        found.append(current)
        splits = dict((first, (to, h)) for first, to, h in SPLITS.get(key, []))
        for i, line in enumerate(lines):
            starts = next((f for f in splits if line.startswith(f) and (i == 0 or not lines[i - 1].strip())), None)
            if starts:
                to, h = splits.pop(starts)
                current = Part(key, h or title, [], to, h)
                found.append(current)
            current.lines.append(line)
        if splits:
            raise SystemExit(f"readme_map: {key!r}: no paragraph starts with {sorted(splits)}")
    return found


def meaningful(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip() and not line.startswith("```")]


def check(text: str) -> int:
    failed = 0
    pages: dict[str, set[str]] = {}
    for part in parts(text):
        target = REPO / part.page if part.page == KEPT else DOCS / part.page
        held = pages.setdefault(part.page, {line.strip() for line in target.read_text().splitlines()}
                                if target.exists() else set())
        lines = meaningful(part.lines)
        share = sum(line in held for line in lines) / len(lines) if lines else 1.0
        ok = share >= COVERED
        failed += not ok
        named = part.key if part.title == part.key.split(" / ")[-1] else f"{part.key} ({part.title})"
        print(f"{'ok  ' if ok else 'MISS'} {share:4.0%}  {named}  ->  {part.page}")
    return 1 if failed else 0


def linked(text: str, page: str) -> str:
    """`text` with each quoted section name of LINKS (and its "below" or "above") a link from `page`."""
    for name, target in LINKS.items():
        path, _, anchor = target.partition("#")
        href = os.path.relpath(DOCS / path, (DOCS / page).parent) + (f"#{anchor}" if anchor else "")
        if path == page:
            href = f"#{anchor}" if anchor else "#"
        words = r"\s+".join(re.escape(word) for word in name.split())  # a name may wrap onto the next line
        text = re.sub(rf'"{words}"(?: below| above)?', lambda _: f"[{name}]({href})", text)
    return text


def move(text: str) -> None:
    appended: dict[str, list[str]] = {}
    for part in parts(text):
        if part.page == KEPT:
            continue
        body = appended.setdefault(part.page, [])
        body += ["", f"## {part.heading or part.title}", ""] if part.heading is not None else [""]
        body += part.lines
    for page, lines in appended.items():
        path = DOCS / page
        moved = linked(re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip(), page)
        path.write_text(path.read_text().rstrip("\n") + "\n" + moved + "\n")
        print(f"{page}: +{len(lines)} lines")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--move", action="store_true", help="append each part of the README to its page")
    parser.add_argument("--readme", help="read this README instead of the one at BEFORE")
    args = parser.parse_args()
    if args.readme:
        text = Path(args.readme).read_text()
    else:
        text = subprocess.run(["git", "show", f"{BEFORE}:README.md"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
    if args.move:
        move(text)
        return 0
    return check(text)


if __name__ == "__main__":
    sys.exit(main())
