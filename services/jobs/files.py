"""File uploads: reading a multipart `file` + `purpose` (+ OpenAI's optional `expires_after`) within the size
limit and the deployment's storage quota, and the OpenAI `file` object.

An upload is read as a stream and written to Redis chunk by chunk as it arrives (store.FileWriter): no process
holds a whole file. It is refused as soon as it passes the per-file limit (413) or would take the files'
storage past the quota (507; each chunk is counted in Redis before it is stored), and what it wrote is then
deleted and its bytes given back.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from aiohttp import web
from aiohttp.multipart import BodyPartReader, MultipartReader

from pdserve.services.jobs.errors import ApiError, bad_request, shown
from pdserve.services.jobs.store import FileWriter, QuotaExceeded

UPLOAD_PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"
MAX_FIELD_BYTES = 1024  # the `purpose` form field
MAX_FILENAME_CHARS = 255  # kept with the file for as long as it is
CHUNK = 1 << 16
BODY_IDLE_S = 60.0  # an upload that sends nothing this long is a 408 (the gateway's --body-timeout)
EXPIRY_ANCHORS = ("created_at",)
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600  # OpenAI's bounds on `expires_after[seconds]`


@dataclass(frozen=True)
class Upload:
    filename: str
    purpose: str
    expires_after_s: int | None = None


def size_text(n: int) -> str:
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)" if n >= 1 << 20 else f"{n} bytes"


def too_many(limit: int) -> ApiError:
    return ApiError(507, f"The deployment already stores {limit} files, the most it keeps (--max-files). Delete "
                         "files (or upload them with expires_after), or raise the server's --max-files.",
                    "file", "files_limit_exceeded", type="insufficient_storage", headers={"x-should-retry": "false"})


def quota_full(exc: QuotaExceeded) -> ApiError:
    """507 for an upload refused by the storage quota; `x-should-retry: false` keeps OpenAI's clients from
    sending it again at once (they retry 5xx replies by default)."""
    return ApiError(507, f"The deployment's file storage is full: {size_text(exc.used)} of its quota of "
                         f"{size_text(exc.quota)} are in use by other files, and this upload needs at least "
                         f"{size_text(exc.needed)} where {size_text(max(0, exc.quota - exc.used))} are left. Delete "
                         "files (or upload them with expires_after), or raise the server's --files-quota-bytes.",
                    "file", "files_quota_exceeded", type="insufficient_storage", headers={"x-should-retry": "false"})


def expiry_seconds(anchor: object, seconds: object, param: str, min_s: int = MIN_EXPIRY_S) -> int:
    """The seconds of an OpenAI `expires_after` ({"anchor": "created_at", "seconds": N}); `param` names it in
    errors (e.g. "expires_after" makes "expires_after[seconds]")."""
    if anchor not in EXPIRY_ANCHORS:
        raise bad_request(f"Invalid {param}[anchor] {shown(anchor)}: the only anchor is 'created_at'.",
                          f"{param}[anchor]")
    if seconds is None:
        raise bad_request(f"{param}[seconds] is required with {param}[anchor]: an integer from {min_s} to "
                          f"{MAX_EXPIRY_S} (30 days).", f"{param}[seconds]")
    if isinstance(seconds, str) and re.fullmatch(r"-?[0-9]{1,12}", seconds.strip()):  # ASCII digits only
        seconds = int(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not min_s <= seconds <= MAX_EXPIRY_S:
        raise bad_request(f"{param}[seconds] must be an integer from {min_s} to {MAX_EXPIRY_S} (30 days), not "
                          f"{shown(seconds, 40)}.", f"{param}[seconds]")
    return seconds


def too_large(limit: int, seen: str) -> ApiError:
    return ApiError(413, f"The file is larger than the limit of {size_text(limit)}: {seen}. Split it, or raise the "
                         "server's --max-file-size.", "file", "file_too_large")


async def read_upload(request: web.Request, max_bytes: int, writer: FileWriter,
                      min_expiry_s: int = MIN_EXPIRY_S, idle_s: float = BODY_IDLE_S) -> Upload:
    """Stream the form's `file` into `writer` (started here, left to the caller to commit or discard)."""
    if not request.content_type.startswith("multipart/"):
        raise bad_request("Upload the file as multipart/form-data with fields 'file' and 'purpose'.", "file")
    if request.content_length is not None and request.content_length > max_bytes + (1 << 20):
        # Clearly over, whatever the form overhead: refuse before reading it.
        raise too_large(max_bytes, f"the upload is {size_text(request.content_length)}")
    if writer.quota and request.content_length is not None:
        used, least = await writer.store.usage(), max(1, request.content_length - (1 << 20))  # less its form
        if used + least > writer.quota:  # clearly more than is left
            raise quota_full(QuotaExceeded(used, writer.quota, least))
    try:
        reader = await request.multipart()
    except (ValueError, KeyError):  # no boundary, or a malformed Content-Type
        raise bad_request("The upload is not multipart/form-data with a boundary: send the fields 'file' and "
                          "'purpose' as a form.", "file") from None
    purpose: str | None = None
    filename: str | None = None
    expiry: dict[str, str] = {}
    while (part := await _next_part(reader)) is not None:
        if not isinstance(part, BodyPartReader):  # a nested multipart: no field of this form
            raise bad_request("The upload's form holds a nested multipart part: send the fields 'file' and "
                              "'purpose' as plain form fields.", "file")
        if part.name in ("purpose", "expires_after[anchor]", "expires_after[seconds]"):
            raw = await part.read_chunk(MAX_FIELD_BYTES + 1)
            value = raw.decode("utf-8", "replace").strip()
            if part.name == "purpose":
                purpose = value
            else:  # checked as it arrives (fields sent before the file refuse it before it is stored)
                expiry[part.name[len("expires_after["):-1]] = value
                expiry_seconds(expiry.get("anchor", "created_at"), expiry.get("seconds", str(min_expiry_s)),
                               "expires_after", min_expiry_s)
        elif part.name == "file" and filename is None:
            # Header bytes that are not UTF-8 arrive as lone surrogates, which Redis cannot store: the name
            # is only a label, so they become "?" rather than failing the upload.
            filename = (part.filename or "upload").encode("utf-8", "replace").decode("utf-8")
            if len(filename) > MAX_FILENAME_CHARS:
                raise bad_request(f"The file name has {len(filename)} characters; the limit is "
                                  f"{MAX_FILENAME_CHARS}.", "file")
            await writer.start()
            while chunk := await _within(idle_s, part.read_chunk(CHUNK)):
                if writer.size + len(chunk) > max_bytes:
                    raise too_large(max_bytes, f"read {size_text(writer.size + len(chunk))} of it so far")
                await writer.write(chunk)
        else:
            await part.release()
    if filename is None:
        raise bad_request("Missing the 'file' field.", "file")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(f"Invalid purpose {purpose!r}: use one of {', '.join(UPLOAD_PURPOSES)}.", "purpose")
    expires_after_s = None
    if expiry:  # an anchor left out is 'created_at', the only one
        expires_after_s = expiry_seconds(expiry.get("anchor", "created_at"), expiry.get("seconds"),
                                         "expires_after", min_expiry_s)
    return Upload(filename, purpose, expires_after_s)


async def _within(idle_s: float, read):
    """One read of the upload, or a 408 when nothing arrives for `idle_s` (the caller discards what it wrote)."""
    try:
        async with asyncio.timeout(idle_s):
            return await read
    except TimeoutError:
        raise ApiError(408, f"The upload sent nothing for {idle_s:g} s.", "file", "upload_timeout") from None


async def _next_part(reader: MultipartReader):
    try:
        return await reader.next()
    except ValueError as exc:  # a body that does not follow its boundary
        raise bad_request(f"The upload's form is malformed ({exc}): send the fields 'file' and 'purpose' as "
                          "multipart/form-data.", "file") from None


def render(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": meta.get("status", "processed"),
            "expires_at": int(meta["expires_at"]) if meta.get("expires_at") else None, "status_details": None}
