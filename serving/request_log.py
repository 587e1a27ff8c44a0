"""Structured request logs: one JSON line per request on every node it touched, on stderr.

The router logs each request once, when its stream ends, with its timings and where it ran;
prefill and decode nodes log their part of it when it ends there. Every line carries the
``request_id``: the client's (``GenerateRequest.request_id``, else the ``x-request-id`` gRPC
metadata or HTTP header), or one the router draws. It reaches the workers inside
``WorkerRequest.request_id``, so ``grep <id>`` over every node's log follows one request.

A line: ``{"ts": <unix s>, "role": "router", "event": "request", "request_id": "...", ...}``,
written by the ``pdserve.requests`` logger at INFO whatever the root logger's level.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_logger = logging.getLogger("pdserve.requests")


def _ensure_handler() -> None:
    if not _logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        _logger.addHandler(handler)
        _logger.setLevel(logging.INFO)
        _logger.propagate = False


def log_request(role: str, request_id: str, **fields: object) -> None:
    """Write one request's line (``fields`` must be JSON-serialisable; floats are seconds
    turned into milliseconds by the caller)."""
    _ensure_handler()
    line = {"ts": round(time.time(), 3), "role": role, "event": "request",
            "request_id": request_id, **fields}
    _logger.info(json.dumps(line, separators=(",", ":"), default=str))


def request_id_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The ``x-request-id`` of a call's metadata ("" without one; cut to 128 characters)."""
    for key, value in metadata or ():
        if key.lower() == REQUEST_ID_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return text[:MAX_REQUEST_ID_CHARS]
    return ""


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds, rounded for a log line (None stays None)."""
    return None if seconds is None else round(seconds * 1000.0, 3)


class RequestLine:
    """One request's log line, filled in as it runs and written once by :meth:`write`."""

    def __init__(self, role: str, request_id: str) -> None:
        self.role = role
        self.request_id = request_id
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.completion_tokens = 0
        self.status = "OK"  # or how it failed (see :func:`request_line`)
        self.fields: dict[str, object] = {}

    def tokens(self, n: int) -> None:
        """``n`` output tokens went out now."""
        if n and self.first_token is None:
            self.first_token = time.monotonic()
        self.completion_tokens += n

    def write(self) -> None:
        ttft = None if self.first_token is None else self.first_token - self.start
        log_request(self.role, self.request_id, status=self.status, ttft_ms=ms(ttft),
                    e2e_ms=ms(time.monotonic() - self.start),
                    completion_tokens=self.completion_tokens, **self.fields)


@contextmanager
def request_line(role: str, request_id: str, context: Any,
                 **fields: object) -> Iterator[RequestLine]:
    """Log the call running in this block once it ends, however it ends: ``OK``, the status
    it was aborted with, ``CANCELLED`` (client gone, generator closed) or ``INTERNAL``.
    ``context`` is the call's ``grpc.aio.ServicerContext`` (or the router's local one)."""
    line = RequestLine(role, request_id)
    line.fields.update(fields)
    try:
        yield line
    except BaseException as exc:
        line.status = status_of(exc, context)
        raise
    finally:
        line.write()


def status_of(exc: BaseException, context: Any) -> str:
    """The status name a call ended with when ``exc`` ended it."""
    code = getattr(exc, "code", None)  # the router's DoorError carries its code
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"
