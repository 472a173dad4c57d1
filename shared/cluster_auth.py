"""The cluster token: what a process must hold to call a worker's gRPC API or write into its KV pool.

The token is read from the environment only, never from a flag (a command line shows in `ps`):
PDSERVE_CLUSTER_TOKEN, or the file that PDSERVE_CLUSTER_TOKEN_FILE names (compose and Kubernetes mount
secrets as files). `pdserve up`, compose and the Helm chart give every worker and the gateway one; a worker
started by hand without one accepts any caller, and says so in its log when it listens beyond loopback.

- gRPC: every call carries the token as metadata (`x-pdserve-cluster-token`, added by `worker_channel`); a
  worker's server refuses a call without it (UNAVAILABLE is for dead peers, so UNAUTHENTICATED). The
  comparison takes constant time. The metadata crosses the network as is, like an HTTP bearer key: keep
  the workers on a private network (the chart's NetworkPolicy does).
- KV connections (TCP transfer): the token never crosses the wire. The receiver opens each connection with
  a random challenge; the sender answers HMAC-SHA256(token, challenge), which proves it holds the token.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from pathlib import Path

import grpc

from pdserve.shared.logs import client_interceptors

log = logging.getLogger("pdserve.worker")
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_CLUSTER_TOKEN_FILE"
METADATA_KEY = "x-pdserve-cluster-token"
CHALLENGE_BYTES = 32


class TokenError(RuntimeError):
    """The token file named in the environment cannot be read."""


def cluster_token() -> str | None:
    """The token from the environment; None when none is set (workers then accept any caller)."""
    token = os.environ.get(TOKEN_ENV)
    path = os.environ.get(TOKEN_FILE_ENV)
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read the cluster token from {TOKEN_FILE_ENV}={path}: {exc}") from None
    return token or None


def loopback_only(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# ---------------------------------------------------------------- gRPC


def worker_channel(address: str, options=None) -> grpc.aio.Channel:
    """A channel to a worker: every call carries the cluster token (when there is one) and the request id."""
    interceptors = client_interceptors()
    token = cluster_token()
    if token is not None:
        interceptors += [_UnaryToken(token), _StreamToken(token), _BidiToken(token)]
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _StreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _BidiToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.token), request_iterator)


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, token)))


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry the cluster token."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

    async def intercept_service(self, continuation, details):
        given = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.token):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = f"this worker requires the cluster token ({TOKEN_ENV}) on every call"

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as the streaming handler it replaces

    if handler.stream_stream is not None:  # GenerateMany: refused before a single call on it is read
        return handler._replace(stream_stream=refuse_stream)
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=refuse)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=refuse_stream)
    return handler._replace(unary_unary=refuse)


def server_interceptors(host: str) -> list[grpc.aio.ServerInterceptor]:
    """For a worker's server on `host`: the token check when this process has a token."""
    token = cluster_token()
    if token is not None:
        return [TokenCheck(token)]
    if not loopback_only(host):
        log.warning("no cluster token (%s): any process that reaches %s may call this worker and write into its "
                    "KV pool", TOKEN_ENV, host)
    return []


# ---------------------------------------------------------------- KV connections


def challenge() -> bytes:
    return os.urandom(CHALLENGE_BYTES)


def proof(token: str | None, nonce: bytes) -> bytes:
    """What a KV sender answers to the receiver's challenge (a fixed-size digest, token or not)."""
    return hmac.new((token or "").encode(), nonce, hashlib.sha256).digest()


def proves(token: str | None, nonce: bytes, answer: bytes) -> bool:
    """Whether `answer` proves the sender holds `token`; with no token, any answer does."""
    return token is None or hmac.compare_digest(proof(token, nonce), answer)


PROOF_BYTES = hashlib.sha256().digest_size
