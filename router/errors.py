"""The router's error for a failed worker call, shared by the worker pool, rooms and the relay."""

from __future__ import annotations

import grpc

from serving.overload import retry_after_ms, retry_metadata


class WorkerFailure(Exception):
    """A worker call failed: the status to give the client (with the worker's retry hint,
    ``trailing``, when it refused the room as overloaded)."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing = trailing

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError, role: str, address: str) -> WorkerFailure:
        hint = retry_after_ms(exc.trailing_metadata())
        trailing = retry_metadata(hint) if hint is not None else ()
        return cls(exc.code(), f"{role} worker {address}: {exc.details()}", trailing)
