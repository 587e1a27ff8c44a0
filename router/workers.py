"""Worker pool: one channel per worker, local load counters refreshed by periodic ``GetLoad``
calls, and least-loaded selection.

Load of a worker = the larger of what this router has outstanding on it (updated the moment a
request is assigned or released) and what the worker last reported (which also covers other
routers' work). Workers whose last ``GetLoad`` failed sort after healthy ones but are still
picked when nothing else is left, so the caller gets ``UNAVAILABLE`` naming the address.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from proto.server import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
PREFILL = "prefill"
DECODE = "decode"


@dataclass
class Worker:
    """One worker process and this router's view of its load."""

    address: str
    kind: str  # PREFILL or DECODE (a colocated worker is a DECODE worker)
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    outstanding_tokens: int = 0  # prompt tokens of this router's requests not yet released
    running: int = 0  # this router's requests assigned here and not yet released
    report: wpb.LoadReport = field(default_factory=wpb.LoadReport)
    healthy: bool = True

    def score(self) -> tuple[int, int, int]:
        """Sort key: unhealthy last, then outstanding prompt tokens, then running requests."""
        rep = self.report
        tokens = max(self.outstanding_tokens, rep.waiting_tokens)
        running = max(self.running, rep.running_requests + rep.waiting_requests)
        if self.kind == DECODE:
            return (0 if self.healthy else 1, running, tokens)
        return (0 if self.healthy else 1, tokens, running)

    def acquire(self, prompt_tokens: int) -> None:
        self.outstanding_tokens += prompt_tokens
        self.running += 1

    def release(self, prompt_tokens: int) -> None:
        """Undo one :meth:`acquire`; call exactly once per acquire."""
        self.outstanding_tokens -= prompt_tokens
        self.running -= 1


class WorkerPool:
    """All workers of one kind-set; call :meth:`start` inside the event loop, :meth:`close`
    at shutdown."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 refresh_s: float = 1.0, timeout_s: float = 5.0) -> None:
        self.prefill = [_make(a, PREFILL) for a in prefill]
        self.decode = [_make(a, DECODE) for a in decode]
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None

    @property
    def all(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    async def start(self) -> None:
        """Poll every worker once, then keep polling in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.all:
            await w.channel.close()

    async def refresh(self) -> None:
        """One ``GetLoad`` on every worker, concurrently."""
        await asyncio.gather(*(self._refresh_one(w) for w in self.all))

    async def _refresh_one(self, w: Worker) -> None:
        try:
            w.report = await w.stub.GetLoad(wpb.GetLoadRequest(), timeout=self.timeout_s)
            w.healthy = True
        except grpc.aio.AioRpcError as exc:
            if w.healthy:
                log.warning("worker %s: GetLoad failed: %s", w.address, exc.code().name)
            w.healthy = False

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    @staticmethod
    def pick(workers: Sequence[Worker]) -> Worker:
        """The least loaded of ``workers`` (first one on ties)."""
        return min(workers, key=lambda w: w.score())

    async def bootstrap_of(self, w: Worker) -> str:
        """The prefill's transfer bootstrap ``HOST:PORT`` (asks it once if not known yet)."""
        if not w.report.bootstrap:
            await self._refresh_one(w)
        return w.report.bootstrap


def _make(address: str, kind: str) -> Worker:
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    if kind == PREFILL:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
    else:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    return Worker(address, kind, channel, stub)
