"""The pipelined staged send: rounds, halves, and no write left in flight (fakes, no engine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from transfer.plan.heads import HeadCopy
from transfer.tp.staged_send import send_staged

COPY = HeadCopy(0, 2, 0, 2, 4, 2, 4)


class FakeStaging:
    """Records gathers; fails on request; checks no gather hits a half being written."""

    def __init__(self, nbytes: int, writing: set[int], fail_at: int = -1) -> None:
        self.ptr, self.nbytes, self.device = 1 << 20, nbytes, "cpu"
        self.writing, self.fail_at = writing, fail_at
        self.gathers: list[tuple[list[int], int]] = []

    def gather(self, pages: Sequence[int], head_start: int, head_count: int,
               offset: int = 0) -> None:
        assert (head_start, head_count) == (2, 2)
        assert offset not in self.writing, "gather into a half still being written"
        if len(self.gathers) == self.fail_at:
            raise ValueError("gather failed")
        self.gathers.append((list(pages), offset))


def _run(nbytes: int, n: int, fail_at: int = -1) -> tuple[FakeStaging, list[list[int]], set]:
    writing: set[int] = set()
    staging = FakeStaging(nbytes, writing, fail_at)
    written: list[list[int]] = []
    lock = threading.Lock()

    def write(srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        half = srcs[0] - staging.ptr
        with lock:
            writing.add(half)
        time.sleep(0.01)  # long enough for the next gather to run meanwhile
        written.append(dsts)
        with lock:
            writing.discard(half)
        return len(srcs)

    with ThreadPoolExecutor(1) as writer:
        send_staged(write, staging, writer, [(0, 0)], 1, [0], list(range(n)),
                    list(range(100, 100 + n)), COPY, 64)
    return staging, written, writing


def test_rounds_alternate_halves_and_cover_every_page() -> None:
    staging, written, writing = _run(nbytes=256, n=5)  # halves of 128 bytes: 2 pages a round
    assert [g for g, _ in staging.gathers] == [[0, 1], [2, 3], [4]]
    assert [o for _, o in staging.gathers] == [0, 128, 0]
    assert written == [[100 * 64], [102 * 64], [104 * 64]]  # one block per run of pages
    assert not writing


def test_a_failed_gather_waits_for_the_write_in_flight() -> None:
    staging = FakeStaging(256, set(), fail_at=1)
    written: list[int] = []

    def write(srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        time.sleep(0.05)
        written.append(dsts[0])
        return 1

    writer = ThreadPoolExecutor(1)
    with pytest.raises(ValueError, match="gather failed"):
        send_staged(write, staging, writer, [(0, 0)], 1, [0], [0, 1, 2, 3], [9, 10, 11, 12],
                    COPY, 64)
    assert written == [9 * 64]  # round 0's write had returned before the error came out
    writer.shutdown()
