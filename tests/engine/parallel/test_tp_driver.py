"""How rank 0 names a rank's failure, with stand-in rank processes (forked, no model): a rank's
own report wins, then a rank's death, then rank 0's own exception; a starting rank is ready, or
failed with its report, or exited without one."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import pytest

from engine.parallel.driver import _ready_report, step_failure
from engine.parallel.messages import RankReport

Rank = tuple[BaseProcess, Connection]


def _stand_in(conn: Connection, error: str | None, code: int, linger_s: float) -> None:
    if error is not None:
        conn.send_bytes(RankReport(1, error).encode())
    time.sleep(linger_s)
    os._exit(code)


@pytest.fixture
def start() -> Iterator[object]:
    started: list[BaseProcess] = []

    def start_rank(error: str | None = None, code: int = 1, linger_s: float = 0.0) -> Rank:
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_stand_in, args=(theirs, error, code, linger_s), daemon=True)
        proc.start()
        theirs.close()
        started.append(proc)
        return proc, ours

    yield start_rank
    for proc in started:
        proc.kill()
        proc.join()


def failure(*ranks: Rank, wait_s: float = 2.0) -> str:
    exc = RuntimeError("Connection closed by peer")
    return str(step_failure([p for p, _ in ranks], [c for _, c in ranks], exc, wait_s))


def test_a_ranks_report_names_it_and_what_it_raised(start) -> None:  # noqa: ANN001
    quiet = start(linger_s=30)
    reported = start("RuntimeError: out of memory", code=1)
    reported[0].join()
    assert failure(quiet, reported) == "tensor-parallel rank 2 failed: RuntimeError: out of memory"


def test_a_rank_that_died_silently_is_named_with_its_exit_code(start) -> None:  # noqa: ANN001
    dead = start(code=3)
    dead[0].join()
    assert failure(start(linger_s=30), dead) == \
        "tensor-parallel rank 2 died during a step (exit code 3)"


def test_with_every_rank_alive_and_silent_rank_0s_error_is_named(start) -> None:  # noqa: ANN001
    message = failure(start(linger_s=30), wait_s=0.2)
    assert message == ("tensor-parallel step failed on rank 0: RuntimeError: Connection closed "
                       "by peer")


def test_a_starting_rank_is_ready_or_says_why_not(start) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 10
    assert _ready_report(*start("", linger_s=30), deadline).error == ""
    assert _ready_report(*start("CheckpointError: corrupt"), deadline).error == \
        "CheckpointError: corrupt"
    assert _ready_report(*start(code=3), deadline).error == \
        "its process exited (exit code 3) without a report"
    assert _ready_report(*start(linger_s=30), time.monotonic() + 0.2).error.startswith(
        "not ready")


def test_a_ready_report_carries_the_attach_hooks_payload() -> None:
    report = RankReport(2, payload=b"\x00registration\xff")
    assert RankReport.decode(report.encode()) == report
    failed = RankReport(1, "boom: \u00e9", b"tail")
    assert RankReport.decode(failed.encode()) == failed
