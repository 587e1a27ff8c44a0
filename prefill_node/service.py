"""The prefill node's gRPC service: ``Prefill`` returns once a room's KV is delivered, with the
prompt's log-probabilities when the request asked for them (and the loop computes them).

Admission is bounded (:class:`serving.admission.AdmissionGate`): a new room is refused with
``RESOURCE_EXHAUSTED`` (and a retry hint) while ``max_waiting`` rooms already wait here (gated on
their destination or waiting for the scheduler). A room the loop refuses ends the call with the
status of :mod:`serving.status`."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import AsyncIterator

import grpc

from engine.core.request import Request, SamplingParams
from engine.multimodal.inputs import ImageInput, VideoInput, image_from_array, video_from_array
from prefill_node.loop import PrefillThread
from proto.convert import patches_array, sampling_kwargs, video_patches
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from serving.admin import load_report
from serving.admission import DEFAULT_MAX_WAITING, AdmissionGate
from serving.blocking import to_thread_atomic
from serving.kv_events import KvEventHub, kv_event_stream
from serving.request_log import request_line
from serving.status import STATUS_ERRORS, abort_with_status
from transfer.aux import aux_figures
from transfer.faults import fault_figures

Outcome = tuple[str | None, Request]  # how a room ended: its error (None: delivered), its request


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    """Serves ``PrefillWorker`` over a :class:`PrefillThread`: the whole-model loop or the first
    stage of a pipeline."""

    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        self.admission = AdmissionGate(max_waiting, lambda: self.loop.num_queued(),
                                       "prefill node: {queued} rooms wait")
        # every key exists from the start: stats() copies it from another thread
        self.counters: Counter[str] = Counter(transfers_failed=0)
        self._pending: dict[int, asyncio.Future[Outcome]] = {}
        self._owners: dict[int, str] = {}  # room -> the request id its pending call runs
        self._aio: asyncio.AbstractEventLoop | None = None
        self._loop: PrefillThread | None = None
        self.bootstrap_address = ""
        self.instance_id = secrets.token_hex(8)  # LoadReport.instance_id: new at every start
        self.kv_events: KvEventHub | None = None  # the prefix cache's events, when it has one

    def bind(self, loop: PrefillThread, aio: asyncio.AbstractEventLoop, bootstrap: str) -> None:
        """Attach the prefill loop (whose ``on_done`` is :meth:`on_done`), the asyncio loop
        and the bootstrap endpoint address reported in load reports."""
        self._loop, self._aio, self.bootstrap_address = loop, aio, bootstrap

    @property
    def loop(self) -> PrefillThread:
        assert self._loop is not None, "PrefillService.bind() was not called"
        return self._loop

    def on_done(self, room: int, error: str | None, request: Request) -> None:
        """Called on the prefill thread when a room ends."""
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._resolve, room, (error, request))

    def _resolve(self, room: int, outcome: Outcome) -> None:
        fut = self._pending.get(room)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    async def Prefill(  # noqa: N802 - gRPC method name
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> wpb.PrefillResponse:
        req = request.request
        with request_line("prefill", req.request_id, context, room=req.room,
                          prompt_tokens=len(req.token_ids)):
            return await self._prefill(request, context)

    async def _prefill(self, request: wpb.PrefillRequest,
                       context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        req = request.request
        room = req.room
        if room in self._pending:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {room} is running")
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending[room], self._owners[room] = fut, req.request_id
        try:
            await self.admission.admit(context, lambda: self._submit(room, req, context))
            error, done = await fut
        except asyncio.CancelledError:
            await asyncio.to_thread(self.loop.abort, room, "prefill call cancelled")
            raise
        finally:
            del self._pending[room], self._owners[room]
        if error is not None:
            self.counters["transfers_failed"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"room {room} failed: {error}")
        return wpb.PrefillResponse(
            room=room, prompt_tokens=len(req.token_ids), prompt_logprobs=done.prompt_logprobs,
            prompt_top_logprobs=[gpb.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs)
                                 for t in done.prompt_top_logprobs])

    async def _submit(self, room: int, req: wpb.WorkerRequest,
                      context: grpc.aio.ServicerContext) -> None:
        """Validate and gate the room (aborts the call on refusal)."""
        try:
            ids, images, videos, sampling = _inputs(req)
            await to_thread_atomic(self.loop.submit, room, ids, images, sampling, videos=videos)
        except STATUS_ERRORS as exc:
            await abort_with_status(context, exc)

    async def AbortRoom(  # noqa: N802
        self, request: wpb.AbortRoomRequest, context: grpc.aio.ServicerContext
    ) -> wpb.AbortRoomResponse:
        """Abort the room, unless its call runs another request than ``request_id`` names
        (another router's room under the same id: ``found=False``, nothing touched)."""
        owner = self._owners.get(request.room, request.request_id)
        if request.request_id and owner != request.request_id:
            return wpb.AbortRoomResponse(found=False)
        reason = request.reason or "aborted by the router"
        found = await asyncio.to_thread(self.loop.abort, request.room, reason)
        return wpb.AbortRoomResponse(found=found)

    async def GetLoad(  # noqa: N802
        self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> wpb.LoadReport:
        # never behind a step (serving/figures.py)
        report = load_report(self.loop.load(), bootstrap=self.bootstrap_address,
                             instance_id=self.instance_id,
                             page_size=self.loop.engine.config.page_size)
        report.scores_prompts = self.loop.scores_prompts
        return report

    async def SubscribeKvEvents(  # noqa: N802
        self, request: wpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.KvEventBatch]:
        async for batch in kv_event_stream(self.kv_events, context):
            yield batch

    def stats(self) -> dict[str, float]:
        """Figures for ``Admin.GetStats`` (blocking)."""
        figures: dict[str, float] = {**self.loop.stats(), **self.admission.counters,
                                   **self.counters}
        figures.update(aux_figures(self.loop.bootstrap.manager.aux))
        figures.update(fault_figures(self.loop.bootstrap.manager.faults))
        return figures


def _inputs(
    req: wpb.WorkerRequest,
) -> tuple[list[int], list[ImageInput], list[VideoInput], SamplingParams]:
    images = [image_from_array(*patches_array(msg)) for msg in req.images]
    videos = [video_from_array(*video_patches(msg)) for msg in req.videos]
    return (list(req.token_ids), images, videos,
            SamplingParams(**sampling_kwargs(req.sampling, 1), resumed_tokens=req.resumed_tokens))
