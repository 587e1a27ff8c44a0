"""The decode node's gRPC service: ``Decode`` streams a room's tokens as the engine makes them.

Events from the engine thread reach the asyncio loop with one ``call_soon_threadsafe`` per step;
each stream sends everything queued for it since its last write as one message.

Admission is bounded (:class:`serving.admission.AdmissionGate`): a new room is refused with
``RESOURCE_EXHAUSTED`` (and a retry hint) while ``max_waiting`` requests already wait (remote rooms
waiting for pages + local requests waiting to be scheduled), so a flood queues at the router's
clients, not in this node's memory. A room the loop or a prefill's bootstrap endpoint refuses
ends the call with the status of :mod:`serving.status`.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc

from decode_node.clients import BootstrapClients
from decode_node.loop import DecodeLoop, TokenEvent
from engine.core.request import SamplingParams, TopLogprobs
from engine.multimodal.inputs import ImageInput, VideoInput, image_from_array, video_from_array
from proto.convert import patches_array, sampling_kwargs, video_patches
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from serving.admin import load_report
from serving.admission import DEFAULT_MAX_WAITING, AdmissionGate
from serving.blocking import to_thread_atomic
from serving.kv_events import KvEventHub, kv_event_stream
from serving.request_log import request_line
from serving.status import PREFILL_SIDE, STATUS_ERRORS, abort_with_status
from transfer.aux import aux_figures
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.faults import fault_figures

DEFAULT_MAX_NEW_TOKENS = 128


def engine_inputs(
    req: wpb.WorkerRequest,
) -> tuple[list[int], list[ImageInput], list[VideoInput], SamplingParams]:
    """Engine values of a worker request; raises ``ConversionError`` on malformed content."""
    images = [image_from_array(*patches_array(msg)) for msg in req.images]
    videos = [video_from_array(*video_patches(msg)) for msg in req.videos]
    sampling = SamplingParams(**sampling_kwargs(req.sampling, DEFAULT_MAX_NEW_TOKENS),
                              resumed_tokens=req.resumed_tokens)
    return list(req.token_ids), images, videos, sampling


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    """Serves ``DecodeWorker`` over a :class:`DecodeLoop` (colocated: prefill runs here too)."""

    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        self.admission = AdmissionGate(max_waiting, lambda: self.loop.num_queued(),
                                       "decode node: {queued} requests wait for pages")
        # every key exists from the start: stats() copies it from another thread
        self.counters: Counter[str] = Counter(transfers_failed=0)
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._owners: dict[str, str] = {}  # room -> the request id its open stream runs
        self._aio: asyncio.AbstractEventLoop | None = None
        self._loop: DecodeLoop | None = None
        self._clients: BootstrapClients | None = None
        self.instance_id = secrets.token_hex(8)  # LoadReport.instance_id: new at every start
        self.kv_events: KvEventHub | None = None  # the prefix cache's events, when it has one

    def bind(
        self, loop: DecodeLoop, aio: asyncio.AbstractEventLoop, clients: BootstrapClients
    ) -> None:
        """Attach the engine loop (whose ``emit`` is :meth:`emit`), the asyncio loop the
        server runs on and the bootstrap connections; call before serving."""
        self._loop, self._aio, self._clients = loop, aio, clients

    @property
    def loop(self) -> DecodeLoop:
        assert self._loop is not None, "DecodeService.bind() was not called"
        return self._loop

    def emit(self, events: list[TokenEvent]) -> None:
        """Called on the engine thread after each step."""
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._dispatch, events)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            if ev.error is not None and ev.prefill_side:
                self.counters["transfers_failed"] += 1
            queue = self._streams.get(ev.request_id)
            if queue is not None:
                queue.put_nowait(ev)

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gpb.GenerateResponse]:
        req = request.request
        local = request.local_prefill or not request.prefill_bootstrap
        with request_line("decode", req.request_id, context, room=req.room,
                          prompt_tokens=len(req.token_ids), local_prefill=local) as line:
            async with aclosing(self._decode(request, context)) as stream:
                async for msg in stream:
                    line.tokens(len(msg.token_ids))
                    yield msg

    async def _decode(self, request: wpb.DecodeRequest,
                      context: grpc.aio.ServicerContext
                      ) -> AsyncGenerator[gpb.GenerateResponse, None]:
        req = request.request
        rid = str(req.room)
        if rid in self._streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {req.room} is running")
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[rid], self._owners[rid] = queue, req.request_id
        finished = False
        try:
            await self.admission.admit(context, lambda: self._enqueue(request, context))
            while not finished:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                last = events[-1]
                if last.error is not None:  # the room's transfer failed, or this node did
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, last.error,
                                        trailing_metadata=PREFILL_SIDE if last.prefill_side
                                        else ())
                msg = merge_events(req.request_id, events)
                finished = msg.finished
                yield msg
        finally:
            del self._streams[rid], self._owners[rid]
            if not finished:
                await asyncio.to_thread(self.loop.abort, rid)

    async def _enqueue(self, request: wpb.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> None:
        """Validate and queue the room, locally prefilled or remote (aborts the call on
        refusal)."""
        req = request.request
        try:
            ids, images, videos, sampling = engine_inputs(req)
            if request.local_prefill or not request.prefill_bootstrap:
                await to_thread_atomic(self.loop.submit, str(req.room), ids, images, sampling,
                                       videos=videos)
                return
            clients = await self._connect(request.prefill_bootstrap, context)
            await to_thread_atomic(self.loop.submit_remote, req.room, ids, sampling, clients,
                                   images, videos=videos)
        except STATUS_ERRORS as exc:
            await abort_with_status(context, exc)

    async def _connect(self, bootstrap: str,
                       context: grpc.aio.ServicerContext) -> list[DecodeBootstrapClient]:
        """The clients of every address of ``bootstrap`` (a pipeline-parallel prefill lists
        every stage's, in stage order), each address's in :meth:`BootstrapClients.get`'s order
        (rank 0's last); a refusal ends the call with details naming ``bootstrap``."""
        assert self._clients is not None
        try:
            return [c for address in bootstrap.split(",")
                    for c in await asyncio.to_thread(self._clients.get, address.strip())]
        except STATUS_ERRORS as exc:
            await abort_with_status(context, exc, where=f"prefill bootstrap {bootstrap}",
                                    trailing=PREFILL_SIDE)

    async def AbortRoom(  # noqa: N802
        self, request: wpb.AbortRoomRequest, context: grpc.aio.ServicerContext
    ) -> wpb.AbortRoomResponse:
        """Abort the room, unless its stream runs another request than ``request_id`` names
        (another router's room under the same id: ``found=False``, nothing touched)."""
        rid = str(request.room)
        if request.request_id and self._owners.get(rid, request.request_id) != request.request_id:
            return wpb.AbortRoomResponse(found=False)
        found = await asyncio.to_thread(self.loop.abort, rid)
        return wpb.AbortRoomResponse(found=found)

    async def GetLoad(  # noqa: N802
        self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> wpb.LoadReport:
        # never behind a step (serving/figures.py): the event loop meanwhile delivers every
        # stream's tokens, and a router takes a worker whose poll timed out for a dead one
        return load_report(self.loop.load(), instance_id=self.instance_id,
                           page_size=self.loop.engine.config.page_size)

    async def SubscribeKvEvents(  # noqa: N802
        self, request: wpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.KvEventBatch]:
        async for batch in kv_event_stream(self.kv_events, context):
            yield batch

    def stats(self) -> dict[str, float]:
        """Figures for ``Admin.GetStats`` (blocking). ``rooms_active`` counts every room a
        bootstrap client still tracks, failed ones waiting for the prefill's last word
        included: zero means no page or aux slot can still be written by a prefill."""
        figures: dict[str, float] = {**self.loop.stats(), **self.admission.counters,
                                     **self.counters}
        if self._clients is not None:
            figures["rooms_active"] = max(figures["rooms_active"], self._clients.num_rooms())
            figures.update(aux_figures(self._clients.manager.aux))
            figures.update(fault_figures(self._clients.manager.faults))
        return figures


def top_message(top: TopLogprobs) -> gpb.TopLogprobs:
    return gpb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def merge_events(request_id: str, events: list[TokenEvent]) -> gpb.GenerateResponse:
    """One stream message for consecutive events of one request. ``usage.cached_tokens`` rides
    on every message that has any (the router keeps the first it sees: a client stream can end
    on a stop string before the worker's last message), and so do the drafted and accepted
    counts so far (the router keeps the last it sees of an attempt)."""
    msg = gpb.GenerateResponse(request_id=request_id)
    for ev in events:
        msg.token_ids.extend(ev.token_ids)
        msg.logprobs.extend(ev.logprobs)
        msg.top_logprobs.extend(top_message(t) for t in ev.top_logprobs)
        msg.prompt_logprobs.extend(ev.prompt_logprobs)
        msg.prompt_top_logprobs.extend(top_message(t) for t in ev.prompt_top_logprobs)
    last = events[-1]
    if last.cached_tokens:
        msg.usage.cached_tokens = last.cached_tokens
    msg.usage.drafted_tokens, msg.usage.accepted_tokens = last.drafted, last.accepted
    if last.finish_reason is not None:
        msg.finished = True
        msg.finish_reason = last.finish_reason.value
        msg.usage.prompt_tokens = last.prompt_tokens
        msg.usage.completion_tokens = last.completion_tokens
    return msg
