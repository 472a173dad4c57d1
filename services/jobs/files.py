"""File uploads: reading a multipart `file` + `purpose` within the size limit, and the OpenAI `file` object.

An upload is read as a stream and written to Redis chunk by chunk as it arrives (store.FileWriter): no process
holds a whole file. It is refused (413) as soon as it passes the limit, and what it wrote is then deleted.
"""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from pdserve.services.jobs.errors import ApiError, bad_request
from pdserve.services.jobs.store import FileWriter

UPLOAD_PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"
MAX_FIELD_BYTES = 1024  # the `purpose` form field
CHUNK = 1 << 16


@dataclass(frozen=True)
class Upload:
    filename: str
    purpose: str


def size_text(n: int) -> str:
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)" if n >= 1 << 20 else f"{n} bytes"


def too_large(limit: int, seen: str) -> ApiError:
    return ApiError(413, f"The file is larger than the limit of {size_text(limit)}: {seen}. Split it, or raise the "
                         "server's --max-file-size.", "file", "file_too_large")


async def read_upload(request: web.Request, max_bytes: int, writer: FileWriter) -> Upload:
    """Stream the form's `file` into `writer` (started here, left to the caller to commit or discard)."""
    if not request.content_type.startswith("multipart/"):
        raise bad_request("Upload the file as multipart/form-data with fields 'file' and 'purpose'.", "file")
    if request.content_length is not None and request.content_length > max_bytes + (1 << 20):
        # Clearly over, whatever the form overhead: refuse before reading it.
        raise too_large(max_bytes, f"the upload is {size_text(request.content_length)}")
    reader = await request.multipart()
    purpose: str | None = None
    filename: str | None = None
    while (part := await reader.next()) is not None:
        if part.name == "purpose":
            raw = await part.read_chunk(MAX_FIELD_BYTES + 1)
            purpose = raw.decode("utf-8", "replace").strip()
        elif part.name == "file" and filename is None:
            # Header bytes that are not UTF-8 arrive as lone surrogates, which Redis cannot store: the name
            # is only a label, so they become "?" rather than failing the upload.
            filename = (part.filename or "upload").encode("utf-8", "replace").decode("utf-8")
            await writer.start()
            while chunk := await part.read_chunk(CHUNK):
                if writer.size + len(chunk) > max_bytes:
                    raise too_large(max_bytes, f"read {size_text(writer.size + len(chunk))} of it so far")
                await writer.write(chunk)
        else:
            await part.release()
    if filename is None:
        raise bad_request("Missing the 'file' field.", "file")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(f"Invalid purpose {purpose!r}: use one of {', '.join(UPLOAD_PURPOSES)}.", "purpose")
    return Upload(filename, purpose)


def render(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": meta.get("status", "processed"),
            "expires_at": None, "status_details": None}
