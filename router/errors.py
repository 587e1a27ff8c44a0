"""The router's errors: those that carry a gRPC status (a failed worker call, a call that ended
with a status on a door that is not gRPC: the HTTP door), and a door's request body that cannot
be converted."""

from __future__ import annotations

import grpc

from serving.overload import retry_after_ms, retry_metadata
from serving.status import PREFILL_SIDE_KEY

Trailing = tuple[tuple[str, str], ...]


class BadRequest(Exception):
    """A request body that cannot be converted (HTTP 400); the message names the field."""


class StatusError(Exception):
    """A call's outcome as a gRPC status: ``code``, ``details`` and ``trailing`` metadata (a
    retry hint when the call was refused as overloaded)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Trailing = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing = trailing


class WorkerFailure(StatusError):
    """A worker call failed: the status to give the client (with the worker's retry hint when it
    refused the room as overloaded).

    ``blame`` says which worker of the room failed, for the router's recovery
    (:mod:`router.recovery`): ``"prefill"`` (its call failed, or the decode reported the room
    failed on the prefill's side of the transfer), ``"decode"`` (its stream failed or closed
    early), or ``""`` (no worker: the router itself refused).
    """

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Trailing = (),
                 blame: str = "") -> None:
        super().__init__(code, details, trailing)
        self.blame = blame

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError, role: str, address: str) -> WorkerFailure:
        metadata = tuple(exc.trailing_metadata() or ())
        hint = retry_after_ms(metadata)
        trailing = retry_metadata(hint) if hint is not None else ()
        prefill_side = any(key == PREFILL_SIDE_KEY for key, _ in metadata)
        return cls(exc.code(), f"{role} worker {address}: {exc.details()}", trailing,
                   blame="prefill" if prefill_side else role)


class DoorError(StatusError):
    """A call ended with a gRPC status on a door that is not gRPC (see
    :class:`router.service.LocalContext`)."""
