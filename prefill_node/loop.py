"""The prefill node's engine thread: bootstrap gate, chunked prefill, KV push per chunk.

A room's life here:

1. ``submit``: the request is validated and its room claimed on the bootstrap server; it waits
   in the *gate* (no compute) until the decode's destination has arrived.
2. Admitted to the scheduler, it is prefilled in chunks, batched with other rooms. After each
   step the pages its chunk completed are pushed to the decode (``send_chunk``); the last chunk
   pushes the remaining pages, then the aux row (first token, its logprob, the mrope delta), and
   the bootstrap server sends the status.
3. Only then does ``Scheduler.update`` finish the request and free its pages: a page is never
   reused while a write from it may be in flight.

``on_done(room, error)`` is called exactly once per submitted room (``error`` is None on success).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from engine.draft_runner import DraftRunner
from engine.inputs import ImageInput, RequestState
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams
from engine.scheduler import SchedulerOutput
from transfer.aux import AuxRow
from transfer.bootstrap_prefill import PrefillBootstrapServer
from transfer.status import KVPoll

log = logging.getLogger(__name__)
OnDone = Callable[[int, str | None], None]
IDLE_POLL_S = 0.002  # how often gated rooms are polled while nothing else runs


@dataclass
class _Room:
    request: Request
    admitted: bool = False
    pages_sent: int = 0


class PrefillLoop:
    """Owns an :class:`LLMEngine` and a bootstrap server; steps them on a background thread."""

    def __init__(
        self, engine: LLMEngine, bootstrap: PrefillBootstrapServer, on_done: OnDone,
        drafter: DraftRunner | None = None,
    ) -> None:
        self.engine = engine
        self.drafter = drafter
        self.bootstrap = bootstrap
        self._on_done = on_done
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="prefill-loop", daemon=True)
        self._hidden = (0.0,) * engine.model_config.text.hidden_size

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def submit(
        self, room: int, token_ids: Sequence[int], images: Sequence[ImageInput],
        sampling: SamplingParams,
    ) -> None:
        """Validate and gate a room; raises ``InvalidRequestError`` or ``TransferError``."""
        # The prefill computes the prompt and samples exactly one token, the decode's first.
        first_only = replace(sampling, max_new_tokens=1)
        with self._wake:
            req = self.engine.new_request(token_ids, images, first_only, request_id=str(room))
            if room in self._rooms:
                raise ValueError(f"room {room} is already running here")
            self.bootstrap.add_room(room)
            self._rooms[room] = _Room(req)
            self._wake.notify()

    def abort(self, room: int, reason: str) -> bool:
        """Fail a room at any stage; True if it was live."""
        with self._wake:
            r = self._rooms.get(room)
            if r is None:
                return False
            self._finish(room, r, reason)
            return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            sched = self.engine.scheduler
            gated = sum(1 for r in self._rooms.values() if not r.admitted)
            return {
                "waiting_requests": sched.num_waiting + gated,
                "running_requests": sched.num_running,
                "waiting_tokens": sum(r.request.num_prompt_tokens - r.request.num_computed_tokens
                                      for r in self._rooms.values()),
                "kv_pages_used": sched.allocator.num_used,
                "kv_pages_total": sched.allocator.num_pages,
                "rooms_active": self.bootstrap.num_rooms,
            }

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                self._open_gates()
                if not self.engine.scheduler.has_unfinished():
                    self._wake.wait(self._idle_wait_s())
                    continue
                try:
                    self._step()
                except Exception:  # a bug must fail the step's rooms, not hang them
                    log.exception("prefill step failed; failing every room")
                    for room, r in list(self._rooms.items()):
                        self._finish(room, r, "prefill node error")
            # Let threads blocked on the lock (submit, abort, stats) in between steps: a lock
            # released and at once retaken by the same thread would starve them.
            time.sleep(0)

    def _idle_wait_s(self) -> float | None:
        """How long the idle thread sleeps (None: until woken): gated rooms are polled."""
        return IDLE_POLL_S if self._rooms else None

    def _open_gates(self) -> None:
        """Admit rooms whose destination arrived; fail rooms the bootstrap failed."""
        for room, r in list(self._rooms.items()):
            if r.admitted:
                continue
            status = self.bootstrap.poll(room)
            if status is KVPoll.Failed:
                self._finish(room, r, self.bootstrap.failure_reason(room))
            elif status >= KVPoll.WaitingForInput:
                self.engine.scheduler.add(r.request)
                r.admitted = True

    def _step(self) -> None:
        out = self.engine.scheduler.schedule()
        if not out.items:
            return
        if self.drafter is None:
            samples, seeds = self.engine.forward(out), {}
        else:  # the draft's KV travels with the target's; its last feature rides in the aux row
            samples, fwd = self.engine.forward_states(out)
            seeds = self.drafter.prefill(out, samples, fwd)
        failed = self._push(out, samples, seeds)
        finished = self.engine.scheduler.update(out, samples)
        for room in failed:
            self._finish(room, self._rooms[room], self.bootstrap.failure_reason(room))
        for req in finished:
            room = int(req.request_id)
            if room in self._rooms:  # its last chunk was delivered: status is Success
                self._finish(room, self._rooms[room], None)

    def _push(self, out: SchedulerOutput, samples: list[tuple[int, float]],
              seeds: dict[str, torch.Tensor]) -> list[int]:
        """Send every page this step completed; the aux row with the last chunk. Returns the
        rooms whose transfer failed."""
        failed = []
        sample_iter = iter(samples)
        page_size = self.engine.config.page_size
        for item in out.items:
            req = item.request
            room = int(req.request_id)
            r = self._rooms[room]
            end = item.start + item.num_tokens
            last: AuxRow | None = None
            if item.needs_sample:
                token, logprob = next(sample_iter)
                state = req.payload
                assert isinstance(state, RequestState)
                seed = seeds.get(req.request_id)
                hidden = self._hidden if seed is None else tuple(seed.tolist())
                last = AuxRow(room, token, logprob, state.delta, hidden)
                done_pages = -(-end // page_size)
            else:
                done_pages = end // page_size
            pages = req.page_ids[r.pages_sent : done_pages]
            if not pages and last is None:
                continue
            r.pages_sent = done_pages
            if self.bootstrap.send_chunk(room, pages, last=last) is KVPoll.Failed:
                failed.append(room)
        return failed

    def _finish(self, room: int, r: _Room, error: str | None) -> None:
        """Release everything the room holds, exactly once, and report it."""
        del self._rooms[room]
        if not r.request.is_finished:
            self.engine.scheduler.abort(r.request.request_id)
        if error is not None:
            self.bootstrap.abort(room, error)
        self.bootstrap.release(room)
        self._on_done(room, error)
