"""The rooms of a prefill loop: the bootstrap gate, the pages pushed after each chunk, and the
one way a room ends. Shared by the whole-model loop (:mod:`prefill_node.loop`) and the first
stage of a pipeline (:mod:`prefill_node.pipeline.first`).

A room is a validated request whose room id is claimed on the bootstrap server. It waits at the
*gate* (not in the scheduler, no compute) until the decode's destination has arrived; then it
joins the scheduler. After each step the pages its chunk completed are pushed; the last chunk
pushes the rest and finishes the transfer. Only then does ``Scheduler.update`` finish the
request and free its pages: a page is never reused while a write from it may be in flight.

A prefix-cache hit (``engine/core/prefix_cache.py``) makes the first chunk start past the cached
pages, which hold valid KV and are pushed with it; the bootstrap server drops the pages the
decode holds already (``Destination.cached_pages``).

Every method runs with the owning loop's lock held. Invariant: a room ends exactly once, through
:meth:`PrefillRooms.finish`, which releases everything it holds and calls ``on_done(room,
error, request)`` (``error`` None on success; ``request`` is the room's, finished: what it
recorded, such as its prompt's log-probabilities, no longer changes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.errors import DuplicateRequestError
from engine.llm_engine import LLMEngine
from transfer.aux import AuxRow
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.status import KVPoll

OnDone = Callable[[int, str | None, Request], None]


def completed_pages(end: int, page_size: int, last: bool) -> int:
    """How many of a room's pages are complete once its first ``end`` tokens are computed: the
    partly filled last page counts on the room's last chunk only."""
    return -(-end // page_size) if last else end // page_size


@dataclass
class PrefillRoom:
    request: Request
    admitted: bool = False  # past the gate, in the scheduler
    pages_sent: int = 0


class PrefillRooms:
    """The rooms of one prefill loop (see the module docstring)."""

    def __init__(self, engine: LLMEngine, bootstrap: PrefillBootstrapServer,
                 on_done: OnDone) -> None:
        self.engine = engine
        self.bootstrap = bootstrap
        self._on_done = on_done
        self._rooms: dict[int, PrefillRoom] = {}

    def __bool__(self) -> bool:
        return bool(self._rooms)

    @property
    def gated(self) -> bool:
        """Whether a room waits at the gate."""
        return any(not r.admitted for r in self._rooms.values())

    def add(self, room: int, request: Request) -> None:
        """Claim ``room`` on the bootstrap server and gate it; raises ``DuplicateRequestError``
        when it is already here, ``TransferError`` when the bootstrap refuses the claim."""
        if room in self._rooms:
            raise DuplicateRequestError(f"room {room} is already running here")
        self.bootstrap.add_room(room)
        self._rooms[room] = PrefillRoom(request)

    def open_gates(self, ready: Callable[[int], bool] = lambda room: True) -> None:
        """Admit the gated rooms whose destination arrived (and that are ``ready`` elsewhere);
        fail those the bootstrap failed."""
        for room, r in list(self._rooms.items()):
            if r.admitted:
                continue
            status = self.bootstrap.poll(room)
            if status is KVPoll.Failed:
                self.finish(room, self.bootstrap.failure_reason(room))
            elif status >= KVPoll.WaitingForInput and ready(room):
                self.engine.scheduler.add(r.request)
                r.admitted = True

    def push(self, out: SchedulerOutput, aux: Mapping[int, AuxRow] | None = None) -> list[int]:
        """Send every page the step completed; a room's last chunk finishes its transfer, with
        a hybrid model's final linear-attention states (its request's state slot, freed only
        by ``Scheduler.update`` after this) and its row of ``aux`` when given (written after
        the pages). Returns the rooms whose transfer failed."""
        failed = []
        page_size = self.engine.config.page_size
        for item in out.items:
            room = int(item.request.request_id)
            r = self._rooms.get(room)
            if r is None:
                continue
            done = completed_pages(item.start + item.num_tokens, page_size, item.needs_sample)
            pages = item.request.page_ids[r.pages_sent : done]
            if not pages and not item.needs_sample:
                continue
            r.pages_sent = done
            last = aux.get(room) if aux is not None else None
            slot = item.request.state_slot  # a hybrid model's final states go with the last chunk
            status = self.bootstrap.send_chunk(
                room, pages, last=last, finish=item.needs_sample,
                state_slot=slot if item.needs_sample and slot >= 0 else None)
            if status is KVPoll.Failed:
                failed.append(room)
        return failed

    def settle(self, failed: list[int], finished: list[Request]) -> None:
        """After ``Scheduler.update``: fail the rooms whose transfer failed, finish the ones
        whose last chunk was delivered (their status is Success)."""
        for room in failed:
            if room in self._rooms:
                self.finish(room, self.bootstrap.failure_reason(room))
        for req in finished:
            room = int(req.request_id)
            if room in self._rooms:
                self.finish(room, None)

    def finish(self, room: int, error: str | None) -> bool:
        """Release everything ``room`` holds and report it; False when it is not here."""
        r = self._rooms.pop(room, None)
        if r is None:
            return False
        if not r.request.is_finished:
            self.engine.scheduler.abort(r.request.request_id)
        if error is not None:
            self.bootstrap.abort(room, error)
        self.bootstrap.release(room)
        self._on_done(room, error, r.request)
        return True

    def finish_all(self, reason: str) -> None:
        for room in list(self._rooms):
            self.finish(room, reason)

    def num_queued(self) -> int:
        """Rooms waiting here: gated, or in the scheduler's waiting queue."""
        gated = sum(1 for r in self._rooms.values() if not r.admitted)
        return self.engine.scheduler.num_waiting + gated

    def stats(self) -> dict[str, float]:
        sched = self.engine.scheduler
        return {
            **self.engine.stats(),
            "waiting_requests": self.num_queued(),
            "running_requests": sched.num_running,
            "waiting_tokens": sum(r.request.num_prompt_tokens - r.request.num_computed_tokens
                                  for r in self._rooms.values()),
            "rooms_active": self.bootstrap.num_rooms,
            "kv_pages_not_sent": self.bootstrap.pages_not_sent,
            "kv_bytes_not_sent": self.bootstrap.bytes_not_sent,
        }
