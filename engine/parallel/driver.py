"""Rank 0's side of a tensor-parallel engine: it starts the other ranks' processes
(:mod:`engine.parallel.rank`), waits until they are ready, tells them about every forward and sends
them its inputs (:mod:`engine.parallel.messages`), and ends them.

Rank 0 is the engine the caller holds: it schedules, runs the vision tower and the embedding,
runs its share of every forward (the target's, and an EAGLE draft's layer) together with the
other ranks, and samples. A rank that fails
(raises, or its process dies) fails rank 0's step with :class:`TensorParallelError` naming the
rank and what it reported; the engine is then broken for good (:meth:`TPDriver.close` still
ends every process).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from engine.attention.backend import AttentionBatch
from engine.config import EngineConfig
from engine.device import resolve_device
from engine.errors import TensorParallelError
from engine.models.step_extras import NO_EXTRAS, StepExtras
from engine.parallel.group import DistGroup, rank_device, serve_store
from engine.parallel.messages import (
    Command,
    RankReport,
    StateStep,
    StepHeader,
    keep_header,
    move_header,
    pack_step,
    step_header,
    step_message,
)
from engine.parallel.rank import RankAttach, RankSpec, rank_main

READY_TIMEOUT_S = 600.0  # a rank's model load
REPORT_WAIT_S = 2.0  # after a failed step: how long to wait for a rank to say why
STOP_WAIT_S = 10.0  # after STOP: how long a rank may take to exit before it is killed


class TPDriver:
    """The other ranks of rank 0's group, driven from rank 0.

    Build it before rank 0 loads its model (the ranks load theirs meanwhile), build rank 0's
    model with :attr:`group`, then :meth:`connect`. ``attach``: run in every other rank's
    process once its pools exist (:data:`engine.parallel.rank.RankAttach`); what each returned is in
    :attr:`payloads` after :meth:`connect`. ``draft``: an EAGLE draft directory, whose layer
    every rank holds its share of (rank 0 loads its own,
    :class:`engine.runner.draft_runner.DraftHead`)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, num_pages: int,
                 attach: RankAttach | None = None, draft: str | Path | None = None) -> None:
        size = config.tp_size
        device = resolve_device(config.device)
        for rank in range(1, size):  # DeviceError now rather than a rank failing to start
            resolve_device(str(rank_device(device, rank)))
        self.group = DistGroup(0, size)
        self._store = serve_store(size)
        self.failed = False
        self._closed = False
        self.payloads: list[bytes] = []  # ranks 1.. in order, once connected
        ctx = mp.get_context("spawn")
        threads = max(1, torch.get_num_threads() // size)
        spec = RankSpec(str(model_dir), replace(config, num_pages=num_pages), 0,
                        self._store.port, threads, attach,
                        None if draft is None else str(draft))
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(replace(spec, rank=rank), theirs),
                               name=f"pdserve-tp-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)

    def connect(self, device: torch.device) -> None:
        """Wait until every rank has loaded its share, then join the group."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), 1):
            report = _ready_report(proc, conn, deadline)
            if report.error:
                self.failed = True
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} failed to start: {report.error}")
            self.payloads.append(report.payload)
        self.group.join(self._store, device)

    @contextmanager
    def step(self, rows: torch.Tensor, mrope: torch.Tensor, batch: AttentionBatch,
             command: Command = Command.FORWARD, extras: StepExtras = NO_EXTRAS,
             states: StateStep | None = None) -> Iterator[None]:
        """Announce a forward over ``rows`` ``[T, hidden]`` at ``mrope`` ``[3, T]`` with
        ``batch`` and send its inputs; run rank 0's forward inside. ``command``: the target's
        forward (``rows`` are its embeddings) or the draft's (``rows`` are its layer's input,
        :meth:`engine.models.eagle.draft.EagleDraft.layer_input`). ``extras``: the target
        forward's DeepStack rows and features are sent too, so every rank adds them to its
        residual stream (its ``states`` are rank 0's pool: the other ranks apply ``states``, the
        forward's :class:`StateStep`, to their own). A failure of any rank in here raises
        :class:`TensorParallelError`."""
        with self._guard():
            deepstack = extras.deepstack
            self._announce(step_message(step_header(rows, batch, command, deepstack), states))
            self.group.broadcast(pack_step(mrope, batch))
            self.group.broadcast(rows.contiguous())
            if deepstack:
                assert extras.deepstack_rows is not None, "DeepStack features without rows"
                self.group.broadcast(extras.deepstack_rows.to(torch.int64).contiguous())
                self.group.broadcast(torch.stack(deepstack))
            yield

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Have every other rank copy its target K/V of slots ``src`` ``[M]`` to ``dst``."""
        with self._guard():
            self._announce(step_message(move_header(int(src.shape[0]))))
            self.group.broadcast(torch.cat((src, dst)).to(torch.int64))

    def keep_states(self, accepted: torch.Tensor) -> None:
        """Have every other rank keep, in its state pool, the state after the ``accepted``
        ``[R]`` (int64) rows of the first ``R`` sequences of the verify window it ran
        (:meth:`engine.attention.linear.states.LinearStates.keep`)."""
        with self._guard():
            self._announce(step_message(keep_header(int(accepted.shape[0]))))
            self.group.broadcast(accepted.to(torch.int64).contiguous())

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Refuse once broken; turn a failure inside into the failing rank's error."""
        if self.failed:
            raise TensorParallelError("a tensor-parallel rank failed earlier; close this engine")
        try:
            yield
        except Exception as exc:
            self.failed = True
            raise step_failure(self._procs, self._conns, exc) from exc

    def _announce(self, data: bytes) -> None:
        for conn in self._conns:
            conn.send_bytes(data)

    def close(self) -> None:
        """End every rank's process (STOP, then a kill for one that does not exit) and leave
        the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        stop = StepHeader(Command.STOP).encode()
        for conn in self._conns:
            with suppress(OSError):
                if not self.failed:
                    conn.send_bytes(stop)
                conn.close()
        for proc in self._procs:
            proc.join(STOP_WAIT_S if not self.failed else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.group.close()


def _ready_report(proc: BaseProcess, conn: Connection, deadline: float) -> RankReport:
    """What a starting rank says: its report (an empty error when it is ready), or one naming
    its exit or the deadline passing."""
    while not conn.poll(0.05):
        if not proc.is_alive():
            break
        if time.monotonic() > deadline:
            return RankReport(0, f"not ready after {READY_TIMEOUT_S:.0f} s")
    try:
        return RankReport.decode(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(1.0)
        return RankReport(0, f"its process exited (exit code {proc.exitcode}) without a report")


def step_failure(procs: list[BaseProcess], conns: list[Connection], exc: Exception,
                 wait_s: float = REPORT_WAIT_S) -> TensorParallelError:
    """The error of a step that raised ``exc`` on rank 0, ranks ``1..`` being ``procs`` with
    ``conns``: a rank's own report, else a rank's death, else ``exc`` itself, once the ranks
    had ``wait_s`` to report."""
    deadline = time.monotonic() + wait_s
    while True:
        # liveness before reports: a rank that reported and then died is read as its report
        dead = [(rank, p.exitcode) for rank, p in enumerate(procs, 1) if not p.is_alive()]
        for rank, conn in enumerate(conns, 1):
            with suppress(OSError, EOFError):
                if conn.poll():
                    error = RankReport.decode(conn.recv_bytes()).error
                    return TensorParallelError(f"tensor-parallel rank {rank} failed: {error}")
        if dead:
            rank, code = dead[0]
            return TensorParallelError(f"tensor-parallel rank {rank} died during a step "
                                       f"(exit code {code})")
        if time.monotonic() > deadline:
            return TensorParallelError(f"tensor-parallel step failed on rank 0: "
                                       f"{type(exc).__name__}: {exc}")
        time.sleep(0.05)
