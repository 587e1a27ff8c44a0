"""The prefill node's engine thread: bootstrap gate, chunked prefill, KV push per chunk.

A room's life here:

1. ``submit``: the request is validated and its room claimed on the bootstrap server; it waits
   in the *gate* (no compute) until the decode's destination has arrived.
2. Admitted to the scheduler, it is prefilled in chunks, batched with other rooms. After each
   step the pages its chunk completed are pushed to the decode; the last chunk pushes the
   remaining pages, then the aux row (first token, its logprob, the mrope delta, the draft's
   last feature), and the bootstrap server sends the status.
3. Only then does ``Scheduler.update`` finish the request and free its pages (see
   :mod:`prefill_node.rooms`).

``on_done(room, error)`` is called exactly once per submitted room (``error`` is None on success).
The thread, its lock and its failure handling are :class:`serving.engine_thread.EngineThread`'s.
:class:`PrefillThread` is what this loop shares with a pipeline's first stage
(:mod:`prefill_node.pipeline.first`): the room table, abort, figures and the idle policy.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.core.request import SamplingParams, TopLogprobs
from engine.core.scheduler import SchedulerOutput
from engine.errors import TensorParallelError
from engine.llm_engine import LLMEngine
from engine.multimodal.inputs import ImageInput, RequestState, VideoInput
from engine.runner.draft_runner import DraftRunner
from prefill_node.rooms import OnDone, PrefillRooms
from serving.compute_thread import ComputeThread
from serving.engine_thread import EngineThread
from transfer.aux import AuxRow
from transfer.bootstrap.prefill import PrefillBootstrapServer

IDLE_POLL_S = 0.002  # how often gated rooms are polled while nothing else runs
STEP_FAILURE = "prefill node error"  # the reason every room fails with when a step raises


class PrefillThread(EngineThread[None]):
    """The engine thread of a prefill process over a :class:`PrefillRooms` table: what the
    whole-model loop and a pipeline's first stage share. Subclasses add ``submit`` and the
    thread's ``step`` (and may override ``poll`` and ``idle_wait_s``)."""

    scores_prompts = False  # whether a room's prompt log-probabilities reach ``on_done``

    def __init__(self, engine: LLMEngine, bootstrap: PrefillBootstrapServer,
                 on_done: OnDone, compute: ComputeThread | None = None) -> None:
        """``compute``: the thread ``engine`` was built on, which steps it (see
        :class:`~serving.engine_thread.EngineThread`)."""
        super().__init__("prefill-loop", STEP_FAILURE, compute)
        self.engine = engine
        self.bootstrap = bootstrap
        self.rooms = PrefillRooms(engine, bootstrap, on_done)

    @abstractmethod
    def submit(self, room: int, token_ids: Sequence[int], images: Sequence[ImageInput],
               sampling: SamplingParams, *, videos: Sequence[VideoInput] = ()) -> None:
        """Validate and gate a room; raises ``InvalidRequestError`` or ``TransferError``."""

    def abort(self, room: int, reason: str) -> bool:
        """Fail a room at any stage; True if it was live."""
        with self.lock:
            return self.rooms.finish(room, reason)

    def figures(self) -> dict[str, float]:
        """Rooms, requests and pages (lock held)."""
        return self.rooms.stats()

    def num_queued(self) -> int:
        """Rooms waiting for admission: gated ones and those waiting for the scheduler (the
        bound of ``--max-waiting``)."""
        with self.lock:
            return self.rooms.num_queued()

    # ---- the thread's hooks (lock held) --------------------------------------------------

    def poll(self) -> None:
        """Admit rooms whose destination arrived; fail rooms the bootstrap failed."""
        self.rooms.open_gates()

    def has_work(self) -> bool:
        return self.engine.scheduler.has_unfinished()

    def idle_wait_s(self) -> float | None:
        """Gated rooms are polled every ``IDLE_POLL_S``; with none, sleep until woken."""
        return IDLE_POLL_S if self.rooms else None

    def fail_all(self, reason: str) -> None:
        self.rooms.finish_all(reason)

    def fatal(self, exc: Exception) -> bool:
        """A tensor-parallel rank died: the engine cannot step again."""
        return isinstance(exc, TensorParallelError)


class PrefillLoop(PrefillThread):
    """The whole-model prefill: owns an :class:`LLMEngine` and a bootstrap server and steps them
    on a background thread; with ``drafter``, the EAGLE draft's prompt KV travels too."""

    scores_prompts = True

    def __init__(
        self, engine: LLMEngine, bootstrap: PrefillBootstrapServer, on_done: OnDone,
        drafter: DraftRunner | None = None, compute: ComputeThread | None = None,
    ) -> None:
        super().__init__(engine, bootstrap, on_done, compute)
        self.drafter = drafter
        self._hidden = (0.0,) * engine.model_config.text.hidden_size

    def submit(
        self, room: int, token_ids: Sequence[int], images: Sequence[ImageInput],
        sampling: SamplingParams, *, videos: Sequence[VideoInput] = (),
    ) -> None:
        """Validate and gate a room; raises ``InvalidRequestError`` or ``TransferError``."""
        # The prefill computes the prompt and samples exactly one token, the decode's first; the
        # prompt's log-probabilities, when asked for, go back in the Prefill call's response.
        first_only = replace(sampling, max_new_tokens=1)
        self.engine.structured.check(sampling)  # a grammar compiles here, not under the lock
        with self.lock:
            req = self.engine.new_request(token_ids, images, first_only, request_id=str(room),
                                          videos=videos)
            self.rooms.add(room, req)
            self.lock.notify()

    def step(self) -> None:
        """One prefill step (lock held): forward, push pages and aux rows, settle rooms."""
        out = self.engine.scheduler.schedule()
        if not out.items:
            return
        samples, fwd = self.engine.forward_states(out)
        # the draft's KV travels with the target's; its last feature rides in the aux row
        seeds = {} if self.drafter is None else self.drafter.prefill(out, samples, fwd)
        failed = self.rooms.push(out, self._aux_rows(out, samples, fwd.tops, seeds))
        finished = self.engine.scheduler.update(out, samples, fwd.tops)
        self.rooms.settle(failed, finished)

    def _aux_rows(self, out: SchedulerOutput, samples: list[tuple[int, float]],
                  tops: list[TopLogprobs | None],
                  seeds: dict[str, torch.Tensor]) -> dict[int, AuxRow]:
        """The aux row of each room whose last chunk ran in this step (one sample each, with
        its alternatives when the request asked for them)."""
        rows = {}
        sampled = [item.request for item in out.items if item.needs_sample]
        for req, (token, logprob), top in zip(sampled, samples, tops, strict=True):
            state = req.payload
            assert isinstance(state, RequestState)
            seed = seeds.get(req.request_id)
            hidden = self._hidden if seed is None else tuple(seed.tolist())
            room = int(req.request_id)
            rows[room] = AuxRow(room, token, logprob, state.delta, hidden, req.num_cached_tokens,
                                top)
        return rows
