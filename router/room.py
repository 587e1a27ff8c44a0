"""One running request on its workers: the concurrent ``Decode`` stream and ``Prefill`` call,
and one queue that carries everything they produce, in order, to the relay.

Queue items are worker stream messages (``GenerateResponse``), a :class:`WorkerFailure`,
:data:`END` (the decode stream closed), or the prefill's ``PrefillResponse`` when it carries the
prompt's log-probabilities (:attr:`RoomRun.scores_due`). :meth:`RoomRun.close` is synchronous
and idempotent: it cancels the calls still running and fires ``AbortRoom`` at both workers in
the background, so it is safe from a ``finally`` of a cancelled or closed generator. ``AbortRoom``
names the request, so a worker that refused the room because another router's request runs
under the same id (``ALREADY_EXISTS``) leaves that one alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from router.errors import WorkerFailure
from router.workers import Worker

log = logging.getLogger(__name__)
END = object()
Spawn = Callable[[Coroutine[Any, Any, Any]], None]
QueueItem = gpb.GenerateResponse | wpb.PrefillResponse | WorkerFailure | object


class RoomRun:
    """The worker side of one request. ``prefill`` is None when D prefills locally.

    Lifecycle: :meth:`start` once, read :attr:`queue` until a finished message, a failure or
    END, then :meth:`close` exactly once (more calls are no-ops).
    """

    def __init__(self, room: int, request: wpb.WorkerRequest, decode: Worker,
                 prefill: Worker | None, bootstrap: str, spawn: Spawn,
                 timeout_s: float, deadline_s: float | None) -> None:
        self.room = room
        self.request = request
        self.decode = decode
        self.prefill = prefill
        self.bootstrap = bootstrap
        self.queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self.aborted = False
        self.finished = False  # set by the relay once the last message went out
        self._spawn = spawn
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self._prompt_tokens = len(request.token_ids)
        self._call: grpc.aio.UnaryStreamCall[wpb.DecodeRequest, gpb.GenerateResponse] | None
        self._call = None
        self._tasks: list[asyncio.Task[None]] = []
        self._prefill_held = False
        self._closed = False

    @property
    def scores_due(self) -> bool:
        """Whether the prompt's log-probabilities come from the prefill's response (a remote
        prefill, and the request asks for them): the relay holds the first message for them."""
        return self.prefill is not None and self.request.sampling.HasField("prompt_logprobs")

    def start(self) -> None:
        """Start ``Decode`` and (disaggregated) ``Prefill`` concurrently; charge the workers."""
        self.decode.acquire(self._prompt_tokens)
        req = wpb.DecodeRequest(request=self.request, prefill_bootstrap=self.bootstrap,
                                local_prefill=self.prefill is None)
        self._call = self.decode.decode_stub.Decode(req, timeout=self._deadline_s,
                                                    metadata=self.decode.metadata)
        self._tasks.append(asyncio.create_task(self._read_decode(self._call)))
        if self.prefill is not None:
            self.prefill.acquire(self._prompt_tokens)
            self._prefill_held = True
            self._tasks.append(asyncio.create_task(self._run_prefill(self.prefill)))

    async def _read_decode(self, call: Any) -> None:
        try:
            async for msg in call:
                self.queue.put_nowait(msg)
            self.queue.put_nowait(END)
        except grpc.aio.AioRpcError as exc:
            self.queue.put_nowait(WorkerFailure.from_rpc(exc, "decode", self.decode.address))
        except asyncio.CancelledError:  # the call (or this task) was cancelled by close/abort
            self.queue.put_nowait(END)

    async def _run_prefill(self, worker: Worker) -> None:
        try:
            resp = await worker.prefill_stub.Prefill(wpb.PrefillRequest(request=self.request),
                                                     timeout=self._deadline_s,
                                                     metadata=worker.metadata)
            if self.scores_due:
                self.queue.put_nowait(resp)
        except grpc.aio.AioRpcError as exc:
            if not self._closed:
                self.queue.put_nowait(WorkerFailure.from_rpc(exc, "prefill", worker.address))
        finally:
            self._release_prefill()

    def _release_prefill(self) -> None:
        if self._prefill_held and self.prefill is not None:
            self._prefill_held = False
            self.prefill.release(self._prompt_tokens)

    async def abort(self) -> None:
        """Abort on request (the ``Abort`` RPC): the decode worker ends the stream with
        ``finish_reason="abort"``; if it did not know the room yet, the call is cancelled and the
        relay ends the stream itself."""
        self.aborted = True
        found = await self._abort_room(self.decode)
        if self.prefill is not None:
            await self._abort_room(self.prefill)
        if not found and self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Release everything this room holds; synchronous and idempotent."""
        if self._closed:
            return
        self._closed = True
        clean = self.finished
        if self._call is not None and not self._call.done():
            self._call.cancel()
        for task in self._tasks:
            if not task.done():
                task.cancel()
        self.decode.release(self._prompt_tokens)
        self._release_prefill()
        if not clean:  # cancel, failure or abort: make sure both workers dropped the room
            self._spawn(self._abort_room(self.decode))
            if self.prefill is not None:
                self._spawn(self._abort_room(self.prefill))

    async def _abort_room(self, worker: Worker) -> bool:
        try:
            resp = await worker.stub.AbortRoom(
                wpb.AbortRoomRequest(room=self.room, reason="router abort",
                                     request_id=self.request.request_id),
                timeout=self._timeout_s, metadata=worker.metadata)
            return bool(resp.found)
        except grpc.aio.AioRpcError as exc:
            log.warning("AbortRoom(%d) on %s failed: %s", self.room, worker.address,
                        exc.code().name)
            return False
