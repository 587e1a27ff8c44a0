"""Refusing work under overload: ``RESOURCE_EXHAUSTED`` with a retry hint.

The hint travels twice: as trailing metadata ``retry-after-ms: <ms>`` (for programs) and in the
details text (for people). Every bounded queue of every node refuses through
:func:`abort_overloaded`, and the router passes a worker's hint on to its client unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import grpc

RETRY_AFTER_KEY = "retry-after-ms"
DEFAULT_RETRY_AFTER_MS = 500


def retry_metadata(retry_after_ms: int) -> tuple[tuple[str, str], ...]:
    return ((RETRY_AFTER_KEY, str(int(retry_after_ms))),)


def retry_after_ms(metadata: Iterable[tuple[str, Any]] | None) -> int | None:
    """The ``retry-after-ms`` hint in ``metadata`` (None when absent or malformed)."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) if text.isdigit() else None
    return None


async def abort_overloaded(
    context: grpc.aio.ServicerContext, what: str, retry_after: int = DEFAULT_RETRY_AFTER_MS
) -> NoReturn:
    """End the call with ``RESOURCE_EXHAUSTED``: ``what`` is full, retry after ``retry_after``
    milliseconds."""
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{what}; retry after {retry_after} ms",
                        trailing_metadata=retry_metadata(retry_after))
    raise AssertionError("unreachable: abort raises")
