"""The first stage of a pipeline-parallel prefill (rank 0): the prefill loop the router talks to.

It keeps its rooms like a whole-model prefill (:mod:`prefill_node.rooms`); the differences, per
room:

* ``submit`` also announces the room to the next stage (sampling parameters, mrope delta; the
  prompt's ids when the first token's penalties or the last stage's EAGLE draft need them).
* The gate opens only when the destination reached this stage *and* every later stage
  (``NextStageLink.is_ready``); until then the loop polls the next stage every few milliseconds.
* Each step runs this stage's layers, then hands the items, hidden states and positions to the
  next stage in one synchronous call; the last stage samples and its samples come back here.
* This stage pushes only its own layers' pages and finishes a room's transfer without an aux row
  (the last stage writes it). A room fails here when it fails on any stage, and a room that ends
  here is forgotten by the link (or, when it failed, aborted on the next stage with the next
  call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from engine.core.request import Request, SamplingParams
from engine.llm_engine import LLMEngine
from engine.multimodal.inputs import ImageInput, RequestState, VideoInput
from prefill_node.loop import IDLE_POLL_S, PrefillThread
from prefill_node.pipeline.aux_layers import pack_aux
from prefill_node.pipeline.first_runner import FirstStageRunner
from prefill_node.pipeline.link import NextStageLink, pack_step_tensors
from prefill_node.rooms import OnDone
from proto.convert import sampling_message
from proto.pdserve.v1 import worker_pb2 as wpb
from serving.compute_thread import ComputeThread
from transfer.bootstrap.prefill import PrefillBootstrapServer


class FirstStageLoop(PrefillThread):
    """The engine thread of the first stage: its layers of the model, linked to the next stage.
    Serves the same calls as :class:`prefill_node.loop.PrefillLoop`. ``send_prompt_ids``: the
    pipeline's last stage runs an EAGLE draft, whose rows need every room's prompt ids."""

    def __init__(
        self, engine: LLMEngine, bootstrap: PrefillBootstrapServer, on_done: OnDone,
        runner: FirstStageRunner, link: NextStageLink, *, send_prompt_ids: bool = False,
        compute: ComputeThread | None = None,
    ) -> None:
        # no prefix cache on a pipeline: a hit here would leave the later stages without the
        # cached prefix's hidden states (each stage keeps only its own layers' KV)
        engine.disable_prefix_cache()
        super().__init__(engine, bootstrap, self._ended, compute)
        self.runner = runner
        self.link = link
        self._on_done = on_done
        self._send_prompt_ids = send_prompt_ids

    def submit(
        self, room: int, token_ids: Sequence[int], images: Sequence[ImageInput],
        sampling: SamplingParams, *, videos: Sequence[VideoInput] = (),
    ) -> None:
        """Validate, gate and announce a room (one critical section, so an abort racing the
        submit is delivered to the next stage after the announcement)."""
        # the last stage samples the first token; no stage scores the prompt (the router has
        # requests that ask prefilled on their decode: this loop's scores_prompts is False)
        first_only = dataclasses.replace(sampling, max_new_tokens=1, prompt_logprobs=None)
        self.engine.structured.check(sampling)  # a grammar compiles here, not under the lock
        with self.lock:
            req = self.engine.new_request(token_ids, images, first_only, request_id=str(room),
                                          videos=videos)
            self.rooms.add(room, req)
            state = req.payload
            assert isinstance(state, RequestState)
            self.link.announce(wpb.StageRoom(
                room=room, prompt_tokens=req.num_prompt_tokens, mrope_delta=state.delta,
                sampling=sampling_message(dataclasses.asdict(first_only)),
                prompt_ids=(req.prompt_token_ids
                            if sampling.has_penalties or self._send_prompt_ids
                            or (sampling.structured_output and sampling.resumed_tokens) else ()),
                resumed_tokens=sampling.resumed_tokens,
            ))
            self.lock.notify()

    # ---- the thread's hooks (lock held) --------------------------------------------------

    def poll(self) -> None:
        """Call the next stage when news or gated rooms make it due; then admit the rooms
        ready on every stage. A next stage that fails the call fails every room."""
        if self.link.poll_due(self.rooms.gated):
            try:
                self._fail_later(self.link.step().failed)
            except grpc.RpcError as exc:
                self.rooms.finish_all(f"next pipeline stage {self.link.address}: {exc.code()}")
                return
        self.rooms.open_gates(self.link.is_ready)

    def idle_wait_s(self) -> float | None:
        """Gated rooms and undelivered news are polled every ``IDLE_POLL_S``."""
        return IDLE_POLL_S if self.rooms or self.link.has_news else None

    def step(self) -> None:
        out = self.engine.scheduler.schedule()
        if not out.items:
            return
        hidden, mrope, aux = self.runner.execute(out)
        items = [wpb.StageItem(room=int(it.request.request_id), start=it.start,
                               num_tokens=it.num_tokens, needs_sample=it.needs_sample)
                 for it in out.items]
        reply = self.link.step(items, *pack_step_tensors(hidden, mrope), pack_aux(aux))
        failed = self.rooms.push(out)
        finished = self.engine.scheduler.update(out, reply.samples)
        self._fail_later(reply.failed)
        self.rooms.settle(failed, finished)  # finished: delivered by this stage and every later

    def _fail_later(self, failed: list[tuple[int, str]]) -> None:
        """Fail the rooms a later stage failed."""
        for room, reason in failed:
            self.rooms.finish(room, f"pipeline stage failed the room: {reason}")

    def _ended(self, room: int, error: str | None, request: Request) -> None:
        """A room ended here: the link forgets it, or aborts it on the next stage."""
        if error is None:
            self.link.forget(room)
        else:
            self.link.abort(room, error)
        self._on_done(room, error, request)
