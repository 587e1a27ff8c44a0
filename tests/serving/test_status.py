"""The exception -> gRPC status table (:mod:`serving.status`): every project exception has a
deliberate entry, no entry hides a later one, and the helpers apply it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

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
from serving.status import (
    PREFILL_SIDE,
    STATUS_ERRORS,
    STATUS_TABLE,
    abort_with_status,
    status_for,
)
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
# The contract, written out once more on purpose: a change to the table changes this too.
EXPECTED: dict[type[Exception], grpc.StatusCode] = {
    DuplicateRequestError: Code.ALREADY_EXISTS,  # a router draws another room id
    InvalidRequestError: Code.INVALID_ARGUMENT,
    OutOfPagesError: Code.RESOURCE_EXHAUSTED,
    OutOfStateSlotsError: Code.RESOURCE_EXHAUSTED,
    DeviceError: Code.FAILED_PRECONDITION,
    ConfigError: Code.INVALID_ARGUMENT,
    CheckpointError: Code.INVALID_ARGUMENT,
    TensorParallelError: Code.UNAVAILABLE,  # the node lost a rank: the router tries another
    EngineError: Code.INVALID_ARGUMENT,
    ConversionError: Code.INVALID_ARGUMENT,
    IncompatiblePeerError: Code.FAILED_PRECONDITION,
    LayerPairingError: Code.FAILED_PRECONDITION,
    HeadLayoutError: Code.FAILED_PRECONDITION,  # the two nodes' TP sizes cannot be paired
    PeerAuthError: Code.UNAUTHENTICATED,
    MessageError: Code.UNAVAILABLE,
    PageListError: Code.UNAVAILABLE,
    EngineCallError: Code.UNAVAILABLE,
    BackendUnavailableError: Code.UNAVAILABLE,
    TransferError: Code.UNAVAILABLE,
    OSError: Code.UNAVAILABLE,
}


def _with_subclasses(cls: type[Exception]) -> Iterator[type[Exception]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _with_subclasses(sub)


# the rooms whose code runs inside a servicer; the launcher's and the CLI's errors (``deploy``,
# ``cli``) never reach one, so they need no status
SERVED_ROOMS = frozenset({"engine", "transfer", "proto", "serving", "prefill_node", "decode_node",
                          "router"})


def project_exceptions() -> list[type[Exception]]:
    """Every exception class of ours a call can meet: the engine's, the transfer layer's, and
    the conversion's (subclasses defined in the rooms that serve calls)."""
    found = [*_with_subclasses(EngineError), *_with_subclasses(TransferError),
             *_with_subclasses(ConversionError)]
    return [cls for cls in found if cls.__module__.split(".")[0] in SERVED_ROOMS]


def test_every_project_exception_has_its_own_entry() -> None:
    """A new exception class fails here until the table (and EXPECTED) map it on purpose."""
    table = dict(STATUS_TABLE)
    missing = [cls.__qualname__ for cls in project_exceptions() if cls not in table]
    assert not missing, f"no deliberate status for {missing}: add them to serving.status"


@pytest.mark.parametrize("cls", project_exceptions(), ids=lambda cls: cls.__qualname__)
def test_each_project_exception_gets_its_status(cls: type[Exception]) -> None:
    assert status_for(cls("boom")) is EXPECTED[cls]


def test_the_table_is_the_contract() -> None:
    assert dict(STATUS_TABLE) == EXPECTED
    assert STATUS_ERRORS == tuple(cls for cls, _ in STATUS_TABLE)


def test_no_entry_is_hidden_by_an_earlier_one() -> None:
    """Most specific first: an entry after one of its base classes could never match."""
    for i, (cls, _) in enumerate(STATUS_TABLE):
        earlier = [base for base, _ in STATUS_TABLE[:i] if issubclass(cls, base)]
        assert not earlier, f"{cls.__qualname__} is hidden by {earlier}"


def test_os_errors_and_bare_value_errors() -> None:
    assert status_for(ConnectionRefusedError("no")) is Code.UNAVAILABLE
    assert status_for(ValueError("a bug")) is None
    assert status_for(RuntimeError("a bug")) is None


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the helper uses: ``abort`` raises."""

    def __init__(self) -> None:
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self.trailing: tuple[tuple[str, str], ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.ended = (code, details)
        self.trailing = trailing_metadata
        raise grpc.aio.AbortError()


def _abort(exc: Exception, where: str = "",
           trailing: tuple[tuple[str, str], ...] = ()) -> _Context:
    context = _Context()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(abort_with_status(context, exc, where, trailing))  # type: ignore[arg-type]
    return context


def test_abort_with_status_ends_the_call_with_the_table_status() -> None:
    assert _abort(InvalidRequestError("empty prompt")).ended == (
        Code.INVALID_ARGUMENT, "empty prompt")
    assert _abort(TransferError("refused"), where="prefill bootstrap h:1").ended == (
        Code.UNAVAILABLE, "prefill bootstrap h:1: refused")
    marked = _abort(TransferError("refused"), trailing=PREFILL_SIDE)  # the router's blame mark
    assert marked.trailing == PREFILL_SIDE == (("pdserve-prefill-side", "1"),)


def test_abort_with_status_reraises_what_the_table_does_not_map() -> None:
    context = _Context()
    with pytest.raises(KeyError):
        asyncio.run(abort_with_status(context, KeyError("bug")))  # type: ignore[arg-type]
    assert context.ended is None
