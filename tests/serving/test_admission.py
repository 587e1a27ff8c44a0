"""The admission gate (:mod:`serving.admission`): the bound counts the queue and the calls being
admitted, a refusal is RESOURCE_EXHAUSTED with a retry hint, and the counters follow."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from serving.admission import AdmissionGate
from serving.overload import RETRY_AFTER_KEY


class _Context:
    def __init__(self) -> None:
        self.ended: tuple[grpc.StatusCode, str, object] | None = None

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: object = ()) -> None:
        self.ended = (code, details, trailing_metadata)
        raise grpc.aio.AbortError()


def test_admits_below_the_bound_and_refuses_at_it() -> None:
    queued = [0]
    gate = AdmissionGate(2, lambda: queued[0], "test node: {queued} rooms wait")
    entered: list[int] = []

    async def enqueue() -> None:
        entered.append(1)

    asyncio.run(gate.admit(_Context(), enqueue))  # type: ignore[arg-type]
    queued[0] = 2
    context = _Context()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(gate.admit(context, enqueue))  # type: ignore[arg-type]
    assert entered == [1]
    assert context.ended is not None
    code, details, trailing = context.ended
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith("test node: 2 rooms wait (--max-waiting 2)")
    assert RETRY_AFTER_KEY in dict(trailing)  # type: ignore[arg-type]
    assert gate.counters == {"requests_total": 1, "requests_rejected": 1}
    assert gate.admitting == 0


def test_calls_being_admitted_count_against_the_bound() -> None:
    """Two calls at once with room for one: the second sees the first and is refused."""
    gate = AdmissionGate(1, lambda: 0, "test node: {queued} rooms wait")
    release = asyncio.Event()

    async def slow_enqueue() -> None:
        await release.wait()

    async def both() -> list[BaseException | None]:
        first = asyncio.create_task(gate.admit(_Context(), slow_enqueue))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        second = asyncio.create_task(gate.admit(_Context(), slow_enqueue))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        release.set()
        return list(await asyncio.gather(first, second, return_exceptions=True))

    first, second = asyncio.run(both())
    assert first is None and isinstance(second, grpc.aio.AbortError)
    assert gate.counters == {"requests_total": 1, "requests_rejected": 1}


def test_a_refused_enqueue_is_not_counted() -> None:
    gate = AdmissionGate(5, lambda: 0, "test node: {queued} rooms wait")

    async def refuse() -> None:
        raise grpc.aio.AbortError()

    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(gate.admit(_Context(), refuse))  # type: ignore[arg-type]
    assert gate.counters == {"requests_total": 0, "requests_rejected": 0}
    assert gate.admitting == 0


@pytest.mark.parametrize("bound", [0, -1])
def test_a_bound_below_one_is_refused(bound: int) -> None:
    """It would refuse every request (the CLI's ``--max-waiting`` refuses it too)."""
    with pytest.raises(ValueError, match=f"max_waiting must be at least 1, got {bound}"):
        AdmissionGate(bound, lambda: 0, "test node")
