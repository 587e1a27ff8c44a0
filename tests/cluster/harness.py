"""Starting real pdserve processes for end-to-end tests and stopping them cleanly."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    proc: subprocess.Popen[str]
    port: int
    log: list[str]
    host: str = "127.0.0.1"  # the address it serves on

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def free_port() -> int:
    """A loopback port free right now, for a node that must come back on the same address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_node(args: Sequence[str], timeout_s: float = 60.0, *, prefix: Sequence[str] = (),
               host: str = "127.0.0.1") -> Node:
    """Run ``pdserve ARGS`` (which must print ``READY <port>``) and wait until it is serving.
    Its output (stdout and stderr) keeps landing in ``Node.log`` after that. ``prefix`` runs
    it through another command (``ip netns exec NS``: inside a network namespace), and
    ``host`` is the address it serves on (its ``--host``)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "cli.main", *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT,
    )
    assert proc.stdout is not None
    log: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        log.append(line)
        if line.startswith("READY "):
            # keep reading: a node's request log lines must never fill the pipe and block it
            threading.Thread(target=_drain, args=(proc, log), daemon=True).start()
            return Node(proc, int(line.split()[1]), log, host)
    proc.kill()
    raise RuntimeError(f"pdserve {' '.join(args)} did not become ready:\n{''.join(log)}")


def _drain(proc: subprocess.Popen[str], log: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)


def stop_node(node: Node, timeout_s: float = 15.0) -> int:
    """SIGTERM, then wait; returns the exit code (kills after ``timeout_s``)."""
    if node.proc.poll() is None:
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()
    return node.proc.returncode


def start_each(starts: Sequence[Callable[[], Node]]) -> list[Node]:
    """Run every ``start`` (a :func:`start_node` call) concurrently; on any failure stop the
    nodes that started and raise the first error."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    nodes: list[Node] = []
    errors: list[BaseException] = []
    for fut in futures:
        exc = fut.exception()
        if exc is None:
            nodes.append(fut.result())
        else:
            errors.append(exc)
    if errors:
        stop_all(nodes)
        raise errors[0]
    return nodes


def start_all(commands: Sequence[Sequence[str]]) -> list[Node]:
    """Start ``pdserve`` ``commands`` concurrently (:func:`start_each`)."""
    return start_each([functools.partial(start_node, cmd) for cmd in commands])


def stop_all(nodes: Sequence[Node]) -> None:
    """Stop ``nodes`` concurrently (each gets SIGTERM, then SIGKILL after a grace period)."""
    if nodes:
        with ThreadPoolExecutor(len(nodes)) as pool:
            list(pool.map(stop_node, nodes))


@contextmanager
def running(*commands: Sequence[str]) -> Iterator[list[Node]]:
    """Start every command in order; stop them all (in reverse) on exit."""
    nodes: list[Node] = []
    try:
        for cmd in commands:
            nodes.append(start_node(cmd))
        yield nodes
    finally:
        for node in reversed(nodes):
            stop_node(node)
