"""File uploads: reading a multipart `file` + `purpose` within the size limit, and the OpenAI `file` object.

An upload is read as a stream and refused (413) as soon as it passes the limit, so an oversized file is
never held in memory or stored.
"""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from pdserve.services.jobs.errors import ApiError, bad_request

UPLOAD_PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"
MAX_FIELD_BYTES = 1024  # the `purpose` form field
CHUNK = 1 << 16


@dataclass(frozen=True)
class Upload:
    filename: str
    purpose: str
    content: bytes


def size_text(n: int) -> str:
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)" if n >= 1 << 20 else f"{n} bytes"


def too_large(limit: int, seen: str) -> ApiError:
    return ApiError(413, f"The file is larger than the limit of {size_text(limit)}: {seen}. Split it, or raise the "
                         "server's --max-file-size.", "file", "file_too_large")


async def read_upload(request: web.Request, max_bytes: int) -> Upload:
    if not request.content_type.startswith("multipart/"):
        raise bad_request("Upload the file as multipart/form-data with fields 'file' and 'purpose'.", "file")
    if request.content_length is not None and request.content_length > max_bytes + (1 << 20):
        # Clearly over, whatever the form overhead: refuse before reading it.
        raise too_large(max_bytes, f"the upload is {size_text(request.content_length)}")
    reader = await request.multipart()
    purpose: str | None = None
    filename: str | None = None
    content: bytes | None = None
    while (part := await reader.next()) is not None:
        if part.name == "purpose":
            raw = await part.read_chunk(MAX_FIELD_BYTES + 1)
            purpose = raw.decode("utf-8", "replace").strip()
        elif part.name == "file":
            # Header bytes that are not UTF-8 arrive as lone surrogates, which Redis cannot store: the name
            # is only a label, so they become "?" rather than failing the upload.
            filename = (part.filename or "upload").encode("utf-8", "replace").decode("utf-8")
            chunks: list[bytes] = []
            size = 0
            while chunk := await part.read_chunk(CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise too_large(max_bytes, f"read {size_text(size)} of it so far")
                chunks.append(chunk)
            content = b"".join(chunks)
        else:
            await part.release()
    if content is None or filename is None:
        raise bad_request("Missing the 'file' field.", "file")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(f"Invalid purpose {purpose!r}: use one of {', '.join(UPLOAD_PURPOSES)}.", "purpose")
    return Upload(filename, purpose, content)


def render(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": meta.get("status", "processed"),
            "expires_at": None, "status_details": None}
