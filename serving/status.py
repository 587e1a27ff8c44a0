"""The one table from project exceptions to gRPC status codes, used by every servicer.

A servicer catches :data:`STATUS_ERRORS` around the work a call asks for and ends the call with
:func:`abort_with_status`; :func:`status_for` is the lookup. The table is ordered, most specific
class first, and the first entry the exception is an instance of decides:

=============================== ======================= ==========================================
exception                       status                  why
=============================== ======================= ==========================================
``DuplicateRequestError``       ``ALREADY_EXISTS``      its room (request) id runs here already
``InvalidRequestError``         ``INVALID_ARGUMENT``    the request itself is refused
``OutOfPagesError``             ``RESOURCE_EXHAUSTED``  the node has no KV pages for it now
``OutOfStateSlotsError``        ``RESOURCE_EXHAUSTED``  no hybrid-model state slot is free now
``DeviceError``                 ``FAILED_PRECONDITION`` (start-up only) a device this machine lacks
``ConfigError``                 ``INVALID_ARGUMENT``    (start-up only) a bad model directory
``CheckpointError``             ``INVALID_ARGUMENT``    (start-up only) bad weight files
``TensorParallelError``         ``UNAVAILABLE``         a rank of the engine died: another worker
``EngineError``                 ``INVALID_ARGUMENT``    any other input the engine refuses
``ConversionError``             ``INVALID_ARGUMENT``    a message whose content cannot convert
``IncompatiblePeerError``       ``FAILED_PRECONDITION`` prefill and decode cannot be paired
``LayerPairingError``           ``FAILED_PRECONDITION`` their KV layers cannot be paired
``HeadLayoutError``             ``FAILED_PRECONDITION`` their TP head layouts cannot be paired
``PeerAuthError``               ``UNAUTHENTICATED``     a peer without the internal token
``MessageError``                ``UNAVAILABLE``         a peer spoke garbage: use another path
``PageListError``               ``UNAVAILABLE``         a transfer refused before a byte moved
``EngineCallError``             ``UNAVAILABLE``         the transfer engine failed a write
``BackendUnavailableError``     ``UNAVAILABLE``         no runtime for the transfer backend
``TransferError``               ``UNAVAILABLE``         any other transfer failure
``OSError``                     ``UNAVAILABLE``         a peer that cannot be reached
=============================== ======================= ==========================================

Errors of the caller's input are ``INVALID_ARGUMENT``; a transfer path that failed is
``UNAVAILABLE``, which the router may retry on other workers. ``MessageError`` is never about the
caller's request (a request that does not parse is refused before the servicer runs, by
:mod:`serving.parsing`): it always concerns a bootstrap peer. A bare ``ValueError`` is not in
the table on purpose: our code raises a project exception for every refusal a call can meet, so
a ``ValueError`` reaching a servicer is a bug and ends the call as gRPC's ``UNKNOWN``.

Refusals that are no exception are written where they happen: ``ALREADY_EXISTS`` for a room or
request id that is already running (a room still winding down in a node's loop raises
``DuplicateRequestError`` there instead), ``RESOURCE_EXHAUSTED`` with a retry hint for a full
queue (:mod:`serving.overload`), ``UNAVAILABLE`` for a room that failed after it was admitted.

Layering: ``serving/`` imports ``transfer.errors`` here, and only here, so that this one table
names every exception (a deliberate exception to the house rule that ``serving/`` imports only
``proto`` and engine types).
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from engine.errors import (
    CheckpointError,
    ConfigError,
    DeviceError,
    DuplicateRequestError,
    EngineError,
    InvalidRequestError,
    OutOfPagesError,
    OutOfStateSlotsError,
    TensorParallelError,
)
from proto.convert import ConversionError
from transfer.errors import (
    BackendUnavailableError,
    EngineCallError,
    HeadLayoutError,
    IncompatiblePeerError,
    LayerPairingError,
    MessageError,
    PageListError,
    PeerAuthError,
    TransferError,
)

Code = grpc.StatusCode
Trailing = tuple[tuple[str, str], ...]

PREFILL_SIDE_KEY = "pdserve-prefill-side"
"""Trailing metadata a decode node sets (to ``"1"``) when a room failed on the prefill's side of
the transfer (its bootstrap endpoint unreachable, the transfer failed or timed out) rather than in
the decode itself: the router then blames the prefill, not the decode."""
PREFILL_SIDE: Trailing = ((PREFILL_SIDE_KEY, "1"),)

STATUS_TABLE: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (DuplicateRequestError, Code.ALREADY_EXISTS),
    (InvalidRequestError, Code.INVALID_ARGUMENT),
    (OutOfStateSlotsError, Code.RESOURCE_EXHAUSTED),
    (OutOfPagesError, Code.RESOURCE_EXHAUSTED),
    (DeviceError, Code.FAILED_PRECONDITION),
    (ConfigError, Code.INVALID_ARGUMENT),
    (CheckpointError, Code.INVALID_ARGUMENT),
    (TensorParallelError, Code.UNAVAILABLE),
    (EngineError, Code.INVALID_ARGUMENT),
    (ConversionError, Code.INVALID_ARGUMENT),
    (IncompatiblePeerError, Code.FAILED_PRECONDITION),
    (LayerPairingError, Code.FAILED_PRECONDITION),
    (HeadLayoutError, Code.FAILED_PRECONDITION),
    (PeerAuthError, Code.UNAUTHENTICATED),
    (MessageError, Code.UNAVAILABLE),
    (PageListError, Code.UNAVAILABLE),
    (EngineCallError, Code.UNAVAILABLE),
    (BackendUnavailableError, Code.UNAVAILABLE),
    (TransferError, Code.UNAVAILABLE),
    (OSError, Code.UNAVAILABLE),
)
"""(exception class, status) pairs, most specific first: the first match decides."""

STATUS_ERRORS: tuple[type[Exception], ...] = tuple(cls for cls, _ in STATUS_TABLE)
"""Every class the table maps: what a servicer catches (``except STATUS_ERRORS``)."""


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status a call ends with when ``exc`` refuses it (None: not in the table)."""
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code
    return None


async def abort_with_status(
    context: grpc.aio.ServicerContext, exc: Exception, where: str = "",
    trailing: Trailing = (),
) -> NoReturn:
    """End the call with ``exc``'s status from the table; the details are ``exc``'s message,
    after ``where: `` when given, with ``trailing`` metadata. Re-raises ``exc`` when the table
    does not map it."""
    code = status_for(exc)
    if code is None:
        raise exc
    await context.abort(code, f"{where}: {exc}" if where else str(exc),
                        trailing_metadata=trailing)
    raise AssertionError("unreachable: abort raises")
