"""Stage 0 of a pipeline-parallel prefill: the :class:`PrefillLoop` the router talks to.

Differences from a whole-model prefill, per room:

* ``submit`` also announces the room to the next stage (sampling parameters, mrope delta).
* The gate opens only when the destination reached this stage *and* every later stage
  (``Downstream.is_ready``); until then the loop polls the next stage every few milliseconds.
* Each step runs this stage's layers, then hands the items, hidden states and positions to the
  next stage in one synchronous call; the last stage samples and its samples come back here.
* This stage pushes only its own layers' pages and finishes a room's transfer without an aux row
  (the last stage writes it). A room fails here when it fails on any stage, and a room given up
  here is aborted on the next stage with the next call.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import grpc

from engine.inputs import ImageInput, RequestState
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.scheduler import SchedulerOutput
from prefill_node.loop import IDLE_POLL_S, OnDone, PrefillLoop, _Room
from prefill_node.pipeline.head_runner import HeadRunner
from prefill_node.pipeline.link import Downstream, pack_step_tensors
from proto.convert import sampling_message
from proto.pdserve.v1 import worker_pb2 as wpb
from transfer.bootstrap_prefill import PrefillBootstrapServer
from transfer.status import KVPoll

log = logging.getLogger(__name__)


class HeadLoop(PrefillLoop):
    """A :class:`PrefillLoop` over the first stage's layers, linked to the next stage."""

    def __init__(
        self, engine: LLMEngine, bootstrap: PrefillBootstrapServer, on_done: OnDone,
        runner: HeadRunner, downstream: Downstream,
    ) -> None:
        super().__init__(engine, bootstrap, on_done)
        self.runner = runner
        self.downstream = downstream

    def submit(
        self, room: int, token_ids: Sequence[int], images: Sequence[ImageInput],
        sampling: SamplingParams,
    ) -> None:
        """Validate, gate and announce a room (one critical section, so an abort racing the
        submit is delivered to the next stage after the announcement)."""
        first_only = dataclasses.replace(sampling, max_new_tokens=1)
        with self._wake:
            req = self.engine.new_request(token_ids, images, first_only, request_id=str(room))
            if room in self._rooms:
                raise ValueError(f"room {room} is already running here")
            self.bootstrap.add_room(room)
            self._rooms[room] = _Room(req)
            state = req.payload
            assert isinstance(state, RequestState)
            self.downstream.announce(wpb.StageRoom(
                room=room, prompt_tokens=req.num_prompt_tokens, mrope_delta=state.delta,
                sampling=sampling_message(dataclasses.asdict(first_only)),
            ))
            self._wake.notify()

    # ---- the thread (lock held) ----------------------------------------------------------

    def _idle_wait_s(self) -> float | None:
        return IDLE_POLL_S if self._rooms or self.downstream.has_news else None

    def _open_gates(self) -> None:
        waiting = any(not r.admitted for r in self._rooms.values())
        if self.downstream.poll_due(waiting):
            try:
                self._apply_failed(self.downstream.step().failed)
            except grpc.RpcError as exc:
                self._fail_all(f"next pipeline stage {self.downstream.address}: {exc.code()}")
                return
        for room, r in list(self._rooms.items()):
            if r.admitted:
                continue
            status = self.bootstrap.poll(room)
            if status is KVPoll.Failed:
                self._finish(room, r, self.bootstrap.failure_reason(room))
            elif status >= KVPoll.WaitingForInput and self.downstream.is_ready(room):
                self.engine.scheduler.add(r.request)
                r.admitted = True

    def _step(self) -> None:
        out = self.engine.scheduler.schedule()
        if not out.items:
            return
        hidden, mrope = self.runner.execute(out)
        items = [wpb.StageItem(room=int(it.request.request_id), start=it.start,
                               num_tokens=it.num_tokens, needs_sample=it.needs_sample)
                 for it in out.items]
        reply = self.downstream.step(items, *pack_step_tensors(hidden, mrope))
        failed = self._push_own(out)
        finished = self.engine.scheduler.update(out, reply.samples)
        self._apply_failed(reply.failed)
        for room in failed:
            if room in self._rooms:
                self._finish(room, self._rooms[room], self.bootstrap.failure_reason(room))
        for req in finished:
            room = int(req.request_id)
            if room in self._rooms:  # delivered by this stage and every later one
                self._finish(room, self._rooms[room], None)

    def _push_own(self, out: SchedulerOutput) -> list[int]:
        """Send the pages this step completed; the last chunk finishes the room without an aux
        row. Returns the rooms whose transfer failed here."""
        failed = []
        page_size = self.engine.config.page_size
        for item in out.items:
            room = int(item.request.request_id)
            r = self._rooms.get(room)
            if r is None:
                continue
            end = item.start + item.num_tokens
            done_pages = -(-end // page_size) if item.needs_sample else end // page_size
            pages = item.request.page_ids[r.pages_sent : done_pages]
            if not pages and not item.needs_sample:
                continue
            r.pages_sent = done_pages
            status = self.bootstrap.send_chunk(room, pages, finish=item.needs_sample)
            if status is KVPoll.Failed:
                failed.append(room)
        return failed

    def _apply_failed(self, failed: list[tuple[int, str]]) -> None:
        for room, reason in failed:
            r = self._rooms.get(room)
            if r is not None:
                self._finish(room, r, f"pipeline stage failed the room: {reason}")

    def _fail_all(self, reason: str) -> None:
        for room, r in list(self._rooms.items()):
            self._finish(room, r, reason)

    def _finish(self, room: int, r: _Room, error: str | None) -> None:
        super()._finish(room, r, error)
        if error is None:
            self.downstream.forget(room)
        else:
            self.downstream.abort(room, error)
