"""A worker process's last step: exit without destroying its transfer engine.

Mooncake's ``TransferEngine`` destructor waits about a second for its own threads, holding the
GIL: a worker that let it run took 1.5 s to stop after SIGTERM, one that skips it 0.1-0.2 s
(2026-12-01, this machine). By the time a worker's
serving function returns it has closed everything (servers stopped, rooms failed, memory
unregistered, tensor-parallel ranks ended), so its last cleanup hands the KV manager to
:func:`keep_until_exit`, and the command ends with :func:`exit_process`: it flushes the standard
streams and the logging handlers and leaves through ``os._exit``, without running the
destructor. The OS releases the engine's sockets and memory at once; peers see the closed
connections a killed worker leaves, which they handle anyway.

Invariant: only a process about to end calls :func:`exit_process`; without anything kept it
returns the status and the process exits the ordinary way.

A worker that can no longer serve (a tensor-parallel rank of its engine died) calls
:func:`end_with_failure`: it logs why and ends the process as SIGTERM does (in-flight calls
drain, cleanups run), and :func:`exit_process` then exits with status 1, so a supervisor (Ray,
Kubernetes) sees a failed worker and peers see it gone, rather than a live one failing every
request.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger(__name__)
_kept: list[object] = []
_failed: list[str] = []  # why this process ends as a failure (end_with_failure)


def keep_until_exit(obj: object) -> None:
    """Hold ``obj`` (and so everything it owns) until the process exits."""
    _kept.append(obj)


def end_with_failure(reason: str) -> None:
    """Log ``reason`` and end this process as SIGTERM would; it exits with status 1."""
    log.error("this worker cannot serve any more and ends: %s", reason)
    _failed.append(reason)
    os.kill(os.getpid(), signal.SIGTERM)


def exit_process(status: int) -> int:
    """End the process now with ``status`` (1 at least after :func:`end_with_failure`) when
    something was kept; else return that status."""
    if _failed:
        status = max(status, 1)
    if not _kept:
        return status
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
