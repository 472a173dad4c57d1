"""Request bodies sent compressed (`Content-Encoding`): refused unless the operator takes them, and then inflated
here, each piece counted as it comes out.

aiohttp would inflate such a body itself, before the gateway saw a byte of it, and its size limit applied to the
inflated bytes only once they existed: 32 KB on the wire became a 33.5 MB body. SGLang and vLLM (uvicorn) never
inflate a request body. So the gateway's server does not either (`app.serve` turns aiohttp's inflation off), and:
- without --inflate-request-bodies, a body with any Content-Encoding but identity is a 415 naming the flag, before
  it is read (with `Accept-Encoding: identity`, as RFC 7694 asks);
- with it, a gzip or deflate body is read as sent (within --max-body-bytes), then inflated on the gateway's CPU pool
  in pieces of at most PIECE bytes, and refused (413) as soon as it passes --max-body-bytes, or grows past
  --max-inflation-ratio times the compressed bytes it came from once over FREE_INFLATION: a bomb costs at most the
  limit in memory, a moment of a pool thread and none of the event loop.
Uploads that the jobs proxy streams through are taken uncompressed only: they go on as they came.
"""
from __future__ import annotations

import zlib

from aiohttp import web

from pdserve.services.gateway.cpu_pool import CpuPool, check_deadline
from pdserve.services.gateway.errors import INFLATED, ApiError
from pdserve.services.gateway.limits import Limits

PIECE = 256 << 10  # most bytes inflated at once
FREE_INFLATION = 1 << 20  # inflated bytes below which the ratio is not checked (small JSON compresses well)
ACCEPTED = ("gzip", "x-gzip", "deflate")


class Unsupported(ApiError):
    """415, with the codings the gateway takes (RFC 7694's Accept-Encoding on a response)."""

    def __init__(self, message: str, accepted: str) -> None:
        super().__init__(415, message)
        self.accepted = accepted

    def response(self, nested: bool = False) -> web.Response:
        response = super().response(nested)
        response.headers["Accept-Encoding"] = self.accepted
        return response


def content_encoding(request: web.Request) -> str | None:
    """The coding of the request's body; None when it has none (or says identity)."""
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    return None if coding in ("", "identity") else coding


def check(request: web.Request, enabled: bool, streamed: bool) -> None:
    """415 for a compressed body the gateway does not take: any, unless `enabled`; one the jobs proxy would
    stream through (`streamed`); a coding other than gzip and deflate (two codings in a row included)."""
    coding = content_encoding(request)
    if coding is None or not request.body_exists:
        return
    if not enabled:
        raise Unsupported(f"Request bodies are taken uncompressed (Content-Encoding: {coding}): send it without "
                          "one, or start the gateway with --inflate-request-bodies.", "identity")
    if streamed:
        raise Unsupported("Uploads are taken uncompressed: send the file without a Content-Encoding.", "identity")
    if coding not in ACCEPTED:
        raise Unsupported(f"Content-Encoding {coding!r} is not taken: gzip and deflate are.", "gzip, deflate")


async def inflate(request: web.Request, limits: Limits, pool: CpuPool) -> None:
    """The request's compressed body, inflated and kept for errors.body_bytes: 413 past --max-body-bytes (as sent,
    or inflated) or --max-inflation-ratio, 400 when it is not what its Content-Encoding says or stops short.
    Inflating is the CPU pool's work, within its bounds: on the event loop, each piece would wait for the
    interpreter behind the pool's threads (zlib lets it go), and a few bodies took the loop for seconds."""
    compressed = await request.read()  # 413 past the limit, as any body
    request[INFLATED] = await pool.run(len(compressed), inflated, content_encoding(request), compressed, limits)


def inflated(coding: str, compressed: bytes, limits: Limits) -> bytes:
    """`compressed` inflated a piece at a time, each counted against the limits as it comes out."""
    inflater = _inflater(coding, compressed)
    pieces: list[bytes] = []
    size, data = 0, compressed
    while True:
        try:
            piece = inflater.decompress(data, PIECE)
        except zlib.error:
            raise ApiError(400, f"The request body is not valid {coding} data.") from None
        data = inflater.unconsumed_tail
        size += len(piece)
        pieces.append(piece)
        _within(limits, size, len(compressed) - len(data))
        check_deadline()
        if inflater.eof and (data or inflater.unused_data):
            raise ApiError(400, f"The request body goes on past the end of its {coding} data.")
        if not data and len(piece) < PIECE:  # all taken, and nothing left inside zlib
            break
    if not inflater.eof:
        raise ApiError(400, f"The request body ends before its {coding} data does.")
    return b"".join(pieces)


def _inflater(coding: str, first: bytes):
    if coding == "deflate" and first[:1] and first[0] & 0x0F != 8:
        return zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, as some clients send it (no zlib header)
    return zlib.decompressobj(zlib.MAX_WBITS | (16 if coding in ("gzip", "x-gzip") else 0))


def _within(limits: Limits, size: int, compressed: int) -> None:
    if size > limits.max_body_bytes:
        raise ApiError(413, f"The request body is larger than the limit of {limits.max_body_bytes / (1 << 20):g} MiB "
                            "once inflated (--max-body-bytes).")
    if size > FREE_INFLATION and size > limits.max_inflation_ratio * compressed:
        raise ApiError(413, f"The request body inflates to more than {limits.max_inflation_ratio} times its "
                            f"compressed size (--max-inflation-ratio): {compressed} bytes became {size}.")
