"""Batch validation and the batch object: what a client may create, what an input file must hold, and how a
stored batch renders as OpenAI's `batch` object.

Request parameters are checked when the batch is created (400/404, nothing stored). The input file is
checked by a batch worker while the batch is `validating`; problems make the batch `failed`, with `errors`
naming each bad line (1-based), and no items are queued. Checking a line needs only that line: uniqueness of
custom_ids across the file is checked in Redis (unique_ids.py), so memory stays bounded whatever the file.
"""
from __future__ import annotations

import codecs
import heapq
import itertools
import json
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.services.jobs.errors import bad_request, invalid_id, shown
from pdserve.services.jobs.files import MIN_EXPIRY_S, expiry_seconds
from pdserve.services.jobs.store import FILE_ID, is_id

# OpenAI's batch endpoints. A batch's endpoint and its lines' urls may name each with or without its "/v1"
# ("/chat/completions" is "/v1/chat/completions"); a batch stores the full path and posts its items there.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
SERVED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # the gateway serves a generation model only
ENDPOINT_SPELLINGS = {**{e: e for e in ENDPOINTS}, **{e.removeprefix("/v1"): e for e in ENDPOINTS}}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_REQUESTS = 50_000
MAX_MODEL_CHARS = 256  # a line's model name: the batch keeps the first one for as long as it is kept
MAX_ERRORS = 100  # errors reported per failed batch; the rest are counted in the last message
MAX_METADATA = 16
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")


def endpoint_path(spelling: object) -> str | None:
    """The full path of the batch endpoint `spelling` names; None when it names none."""
    return ENDPOINT_SPELLINGS.get(spelling) if isinstance(spelling, str) else None


@dataclass(frozen=True)
class CreateParams:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None
    output_expires_after_s: int | None = None  # the output and error files expire this long after creation


def parse_create(body: object, min_expiry_s: int = MIN_EXPIRY_S) -> CreateParams:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise bad_request("'input_file_id' is required and must be a file id string.", "input_file_id")
    if not is_id(file_id, FILE_ID):
        raise invalid_id("file", file_id, FILE_ID, "input_file_id")
    endpoint = endpoint_path(body.get("endpoint"))
    if endpoint not in SERVED_ENDPOINTS:
        raise bad_request(f"Unsupported endpoint {shown(body.get('endpoint'), 80)}: use one of {', '.join(SERVED_ENDPOINTS)} "
                          "(the '/v1' may be left out).", "endpoint", "invalid_endpoint")
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in COMPLETION_WINDOWS:
        raise bad_request(f"Unsupported completion_window {shown(window, 80)}: use '24h'.", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
            raise bad_request(f"'metadata' must be an object of at most {MAX_METADATA} pairs.", "metadata")
        for key, value in metadata.items():
            if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
                raise bad_request("'metadata' keys are strings of at most 64 characters and values strings of "
                                  "at most 512.", "metadata")
            if not (is_text(key) and is_text(value)):
                raise bad_request("'metadata' holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF "
                                  "escape), which is not text.", "metadata")
    expiry = body.get("output_expires_after")
    output_expires_after_s = None
    if expiry is not None:
        if not isinstance(expiry, dict):
            raise bad_request("'output_expires_after' must be an object: {\"anchor\": \"created_at\", "
                              "\"seconds\": N}.", "output_expires_after")
        output_expires_after_s = expiry_seconds(expiry.get("anchor"), expiry.get("seconds"), "output_expires_after",
                                                min_expiry_s)
    return CreateParams(file_id, endpoint, window, metadata, output_expires_after_s)


def is_text(value: str) -> bool:
    """Whether `value` is Unicode text that UTF-8 can store: JSON's "\\ud800" parses to a string that is not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Item:
    index: int  # 0-based position among the file's requests: the order of the output file
    custom_id: str
    body: dict


class LineErrors:
    """The MAX_ERRORS errors of the earliest lines (file-wide ones, line None, after them), in line order; the
    rest are counted. Errors may be added a little out of line order (duplicates are found a chunk late)."""

    def __init__(self) -> None:
        self._kept: list[tuple[float, int, dict]] = []  # a max-heap on (line, arrival): (-line, -arrival, error)
        self._arrival = itertools.count()
        self.dropped = 0

    def add(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        entry = (-(line if line is not None else math.inf), -next(self._arrival),
                 {"code": code, "message": message, "param": param, "line": line})
        if len(self._kept) < MAX_ERRORS:
            heapq.heappush(self._kept, entry)
            return
        self.dropped += 1
        if entry[:2] > self._kept[0][:2]:  # earlier than the latest kept: keep it instead
            heapq.heapreplace(self._kept, entry)

    @property
    def errors(self) -> list[dict]:
        return [error for *_, error in sorted(self._kept, key=lambda e: e[:2], reverse=True)]

    def as_object(self) -> dict:
        data = self.errors
        if self.dropped:
            data.append({"code": "too_many_errors", "message": f"{self.dropped} more errors not listed",
                         "param": None, "line": None})
        return {"object": "list", "data": data}


class NotText(ValueError):
    """The input file is not UTF-8 text."""


class LineSplitter:
    """The lines of a file that arrives in chunks, decoded as UTF-8 on the way: no step needs the whole file.

    Lines end at "\n" (a "\r" before it goes too); a chunk may end in the middle of a line or of a character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._partial: list[str] = []  # the pieces of a line begun in earlier chunks (joined once, when it ends)
        self._offset = 0  # bytes decoded before the current chunk
        self.number = 0  # lines handed out so far

    def feed(self, chunk: bytes, final: bool = False) -> list[tuple[int, str]]:
        """The lines `chunk` completes, numbered from 1; `final`: the file ends here. Each byte is decoded and
        scanned once, however long a line runs over many chunks."""
        try:
            text = self._decoder.decode(chunk, final)
        except UnicodeDecodeError as exc:
            raise NotText(f"The input file is not UTF-8 text ({exc.reason} at byte {self._offset + exc.start}).") \
                from None
        self._offset += len(chunk)
        pieces = text.split("\n")
        if len(pieces) == 1 and not final:
            self._partial.append(text)  # no line ends in this chunk
            return []
        pieces[0] = "".join(self._partial) + pieces[0]
        self._partial = [] if final else [pieces.pop()]
        if final and pieces and pieces[-1] == "":
            pieces.pop()  # the newline that ends the last line starts no line of its own
        out = []
        for piece in pieces:
            self.number += 1
            out.append((self.number, piece.removesuffix("\r")))
        return out


async def numbered_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, str]]:
    """Every (1-based number, line) of a file read as `chunks`; raises NotText."""
    splitter = LineSplitter()
    async for chunk in chunks:
        for numbered in splitter.feed(chunk):
            yield numbered
    for numbered in splitter.feed(b"", final=True):
        yield numbered


class InputChecker:
    """Checks an input file's requests line by line (`feed`), keeping only the errors (at most MAX_ERRORS) and
    a count. Whether each custom_id is unique is for the caller to find out (UniqueIds, or a dict for a small
    file) and to report with `duplicate`. A batch reads its file once to check it, then again to queue the items
    it found and, at the end, to write its output in input order."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.errors = LineErrors()
        self.count = 0  # requests found (duplicates reported so far excepted): the index of the next one

    def feed(self, number: int, line: str) -> Item | None:
        if not line.strip():
            return None
        item = parse_line(line, number, self.endpoint, self.count, self.errors)
        if item is not None:
            self.count += 1
        return item

    def duplicate(self, number: int, custom_id: str, first_line: int) -> None:
        """The request on line `number` reuses the custom_id of line `first_line`: it is not a request."""
        self.count -= 1
        self.errors.add(number, "duplicate_custom_id", f"Line {number}: custom_id {shown(custom_id)} is already "
                        f"used on line {first_line}; each request needs its own.", "custom_id")

    def not_text(self, exc: NotText) -> None:
        self.errors.add(None, "invalid_encoding", str(exc))

    def finish(self) -> LineErrors:
        """The errors that fail the batch (none: it may run its `count` requests)."""
        if not self.count and not self.errors.errors:
            self.errors.add(None, "empty_file", "The input file contains no requests.")
        if self.count > MAX_REQUESTS:
            self.errors.add(None, "too_many_requests", f"The input file has {self.count} requests; a batch holds "
                            f"at most {MAX_REQUESTS}.")
        return self.errors


def parse_input(content: bytes, endpoint: str) -> tuple[list[Item], LineErrors]:
    """Every request of a JSONL input file held in memory (a small one: see InputChecker for the streaming
    form), or the errors that make the batch fail (then no items)."""
    checker, items, first_line = InputChecker(endpoint), [], {}
    try:
        for number, line in LineSplitter().feed(content, final=True):
            item = checker.feed(number, line)
            if item is not None and item.custom_id in first_line:
                checker.duplicate(number, item.custom_id, first_line[item.custom_id])
            elif item is not None:
                first_line[item.custom_id] = number
                items.append(item)
    except NotText as exc:
        checker.not_text(exc)
        return [], checker.errors
    errors = checker.finish()
    return (items, errors) if not errors.errors else ([], errors)


def parse_line(line: str, number: int, endpoint: str, index: int, errors: LineErrors) -> Item | None:
    try:
        request = json.loads(line)
    except json.JSONDecodeError as exc:
        errors.add(number, "invalid_json", f"Line {number} is not valid JSON: {exc.msg} (column {exc.colno}).")
        return None
    if not isinstance(request, dict):
        errors.add(number, "invalid_json", f"Line {number} must be a JSON object.")
        return None
    # Only a \uD800-\uDFFF escape can put a lone surrogate into the parsed line; Redis could not store it.
    if _SURROGATE_ESCAPE.search(line) and not is_text(json.dumps(request, ensure_ascii=False)):
        errors.add(number, "invalid_json", f"Line {number} holds a lone UTF-16 surrogate (an unpaired \\uD800-"
                   "\\uDFFF escape), which is not text.")
        return None
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        errors.add(number, "missing_custom_id", f"Line {number} has no 'custom_id' (a non-empty string).",
                   "custom_id")
        return None
    method = request.get("method", "POST")
    if method != "POST":
        errors.add(number, "invalid_method", f"Line {number}: 'method' must be 'POST', not {shown(method)}.",
                   "method")
        return None
    url = request.get("url")
    if endpoint_path(url) != endpoint:
        errors.add(number, "mismatched_url", f"Line {number}: 'url' is {shown(url)} but the batch endpoint is "
                   f"{endpoint!r}; every request must use the batch endpoint.", "url")
        return None
    body = request.get("body")
    if not isinstance(body, dict):
        errors.add(number, "missing_body", f"Line {number} has no 'body' object.", "body")
        return None
    if body.get("stream"):
        errors.add(number, "invalid_body", f"Line {number}: streaming is not supported in a batch.", "body.stream")
        return None
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
        errors.add(number, "invalid_body", f"Line {number}: 'model' must be a model name of at most "
                   f"{MAX_MODEL_CHARS} characters, not {shown(model, 40)}.", "body.model")
        return None
    return Item(index, custom_id, body)


def render(record: dict) -> dict:
    """The stored batch hash as OpenAI's batch object."""
    def opt_int(key: str) -> int | None:
        value = record.get(key)
        return int(value) if value not in (None, "") else None

    return {
        "id": record["id"], "object": "batch", "endpoint": record["endpoint"],
        "errors": json.loads(record["errors"]) if record.get("errors") else None,
        "input_file_id": record["input_file_id"], "completion_window": record["completion_window"],
        "status": record["status"], "output_file_id": record.get("output_file_id"),
        "error_file_id": record.get("error_file_id"), "created_at": int(record["created_at"]),
        "expires_at": opt_int("expires_at"), **{key: opt_int(key) for key in TIMESTAMPS},
        "request_counts": {"total": int(record.get("total") or 0), "completed": int(record.get("completed") or 0),
                           "failed": int(record.get("failed") or 0)},
        "metadata": json.loads(record["metadata"]) if record.get("metadata") else None,
        "model": record.get("model") or None,
    }
