"""A worker's compute thread (:mod:`serving.compute_thread`): tasks run in order on one thread,
the engine loop runs on the thread that built the engine, and an engine built and stepped on one
thread leaves one OpenMP pool in the process (a second one would make libgomp put its workers
to sleep after every parallel region: the module docstring)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serving.compute_thread import ComputeThread
from serving.engine_thread import EngineThread

ROOT = Path(__file__).resolve().parents[2]


def test_tasks_run_in_order_on_one_thread_and_errors_reach_the_caller() -> None:
    compute = ComputeThread("test-compute")
    seen: list[tuple[int, int]] = []
    futures = [compute.submit(lambda i=i: seen.append((i, threading.get_ident())))
               for i in range(5)]
    for f in futures:
        f.result(timeout=5)
    assert [i for i, _ in seen] == list(range(5))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()

    def bad() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        asyncio.run(compute.call(bad))
    assert asyncio.run(compute.call(lambda: 7)) == 7
    compute.shutdown()
    compute.join(5)


class _Idle(EngineThread[None]):
    def __init__(self, compute: ComputeThread) -> None:
        super().__init__("test-loop", "failure", compute)
        self.ran_on: int | None = None

    def has_work(self) -> bool:
        self.ran_on = threading.get_ident()
        return False

    def idle_wait_s(self) -> float | None:
        return 0.01

    def step(self) -> None:
        raise AssertionError("no work was given")

    def fail_all(self, reason: str) -> None:
        return None


def test_the_engine_loop_runs_on_the_thread_that_built_the_engine() -> None:
    compute = ComputeThread("test-compute")
    builder = compute.submit(threading.get_ident).result(timeout=5)
    loop = _Idle(compute)
    loop.start()
    deadline = time.monotonic() + 5
    while loop.ran_on is None and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert loop.ran_on == builder
    compute.join(5)
    assert not compute._thread.is_alive()  # stop ended the compute thread too


SCRIPT = """
import os, torch
from serving.compute_thread import ComputeThread
torch.set_num_threads(2)
x = torch.randn(1 << 22)

def work():
    for _ in range(3):
        (x * 2).sum()  # parallel regions

compute = ComputeThread("engine")
compute.submit(work).result()  # "built" there
compute.submit(work).result()  # and "stepped" there
print(len(os.listdir("/proc/self/task")))
"""


def test_one_thread_building_and_stepping_leaves_one_openmp_pool() -> None:
    """The process's threads: main, the compute thread and one OpenMP worker for it; an engine
    built on the main thread and stepped on the compute thread leaves one worker more (the
    main thread's pool, idle but counted by libgomp against the CPUs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}

    def threads(script: str) -> int:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True, timeout=120)
        return int(out.stdout.split()[-1])

    one = threads(SCRIPT)
    # built on the main thread, stepped on the compute thread: the main thread's pool stays
    two = threads(SCRIPT.replace('compute.submit(work).result()  # "built" there', "work()"))
    assert two == one + 1
