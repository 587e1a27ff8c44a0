"""Who may call what: TLS for the public port, and token checks as a server interceptor.

Two kinds of token, each a metadata entry a call must carry:

* the public bearer token (``authorization: Bearer <token>``), required by the router on
  ``Generation`` and ``Admin`` calls when it runs with ``--auth-token-file``;
* the internal shared secret (``x-pdserve-internal-token: <secret>``), required by workers on
  the services the router calls (``PrefillWorker``, ``DecodeWorker``, ``Admin``) when they run
  with ``--internal-token-file``; the router sends it on every worker call.

Health and reflection are never guarded (probes and tooling need no secret). Tokens are compared
in constant time; a missing or wrong token is ``UNAUTHENTICATED`` before the servicer runs.
"""

from __future__ import annotations

import hmac
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

AUTHORIZATION = "authorization"
INTERNAL_TOKEN = "x-pdserve-internal-token"
Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Requirement:
    """Calls to any of ``services`` (full names) must carry metadata ``key`` equal to ``value``."""

    services: frozenset[str]
    key: str
    value: str
    what: str  # for the error message: "bearer token" or "internal token"

    def allows(self, metadata: Iterable[tuple[str, Any]]) -> bool:
        expected = self.value.encode()
        for k, v in metadata:
            if k == self.key:
                got = v.encode() if isinstance(v, str) else bytes(v)
                if hmac.compare_digest(got, expected):
                    return True
        return False


def bearer(token: str, services: Iterable[str]) -> Requirement:
    """The public API's rule: ``authorization: Bearer <token>``."""
    return Requirement(frozenset(services), AUTHORIZATION, f"Bearer {token}", "bearer token")


def internal(secret: str, services: Iterable[str]) -> Requirement:
    """The internal ports' rule: ``x-pdserve-internal-token: <secret>``."""
    return Requirement(frozenset(services), INTERNAL_TOKEN, secret, "internal token")


def bearer_token(security: ServerSecurity) -> str | None:
    """The public bearer token among ``security``'s requirements (None without one)."""
    for req in security.requirements:
        if req.key == AUTHORIZATION and req.value.startswith("Bearer "):
            return req.value.removeprefix("Bearer ")
    return None


def bearer_metadata(token: str | None) -> Metadata:
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def internal_metadata(secret: str | None) -> Metadata:
    return ((INTERNAL_TOKEN, secret),) if secret else ()


def read_secret(path: str | Path | None) -> str | None:
    """The token in ``path`` (surrounding whitespace stripped); None without a path.

    Raises ValueError for an empty file (an empty token would guard nothing).
    """
    if path is None:
        return None
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"token file {path} is empty")
    return text


@dataclass(frozen=True)
class TlsFiles:
    """PEM server certificate chain and private key."""

    cert: bytes
    key: bytes

    @classmethod
    def read(cls, cert: str | Path, key: str | Path) -> TlsFiles:
        return cls(Path(cert).read_bytes(), Path(key).read_bytes())

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)])

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side TLS context over the same certificate and key (the HTTP door's)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        with tempfile.TemporaryDirectory() as tmp:  # ssl loads a key only from a file
            cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            cert.write_bytes(self.cert)
            key.touch(mode=0o600)
            key.write_bytes(self.key)
            ctx.load_cert_chain(cert, key)
        return ctx


@dataclass(frozen=True)
class ServerSecurity:
    """How one server is protected: optional TLS and any number of token requirements."""

    tls: TlsFiles | None = None
    requirements: tuple[Requirement, ...] = ()


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to guarded services that lack their token (``UNAUTHENTICATED``)."""

    def __init__(self, requirements: Sequence[Requirement]) -> None:
        self._rules: dict[str, list[Requirement]] = {}
        for req in requirements:
            for service in req.services:
                self._rules.setdefault(service, []).append(req)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method or ""
        service = method.split("/")[1] if method.count("/") >= 2 else ""
        metadata = tuple(handler_call_details.invocation_metadata or ())
        missing = [r for r in self._rules.get(service, ()) if not r.allows(metadata)]
        handler = await continuation(handler_call_details)
        if not missing or handler is None:
            return handler
        return _denying(handler, f"{method}: missing or wrong {missing[0].what}")


def _denying(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that fails every call with ``UNAUTHENTICATED``."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)
        yield  # pragma: no cover - a generator: abort raises first

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)
