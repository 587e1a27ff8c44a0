"""The decode node's disaggregated queues: prealloc and transfer.

A remote room moves through:

* **prealloc**: waits until the pool can hold its prompt's pages *and* the scheduler can still
  finish every running request (``free - owed >= worst case of this request``); then its prompt
  pages are taken and sent to the prefill as the room's destination.
* **transfer**: polled each loop iteration. On ``Success`` the aux row is committed, its echoed
  room id checked, and the request joins the scheduler with the prompt computed and the first
  token appended (or finishes at once when that token ends it). On ``Failed`` the room is
  released to the bootstrap client, which frees its pages once the prefill can no longer write
  into them (through :meth:`RemoteQueues.free_later`, drained by the engine thread).

Every method except :meth:`free_later` runs on the engine thread with the loop lock held.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from engine.inputs import RequestState
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request
from engine.sampling import make_generator
from transfer.bootstrap_decode import DecodeBootstrapClient
from transfer.errors import TransferError
from transfer.status import KVPoll


@dataclass
class RemoteRoom:
    room: int
    request: Request  # prompt and sampling; no pages until prealloc
    client: DecodeBootstrapClient
    pages: list[int] | None = None


@dataclass(frozen=True)
class RoomOutcome:
    """A room that left the remote queues: adopted (``request`` runs now), finished by its
    first token, or failed (``error``)."""

    room: RemoteRoom
    error: str | None = None
    finished: bool = False


class RemoteQueues:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prealloc: dict[int, RemoteRoom] = {}
        self.transfer: dict[int, RemoteRoom] = {}
        self._to_free: queue.SimpleQueue[list[int]] = queue.SimpleQueue()

    def free_later(self, pages: list[int]) -> None:
        """Bootstrap-client callback (any thread): pages that are safe to reuse."""
        self._to_free.put(pages)

    def __contains__(self, room: int) -> bool:
        return room in self.prealloc or room in self.transfer

    @property
    def num_rooms(self) -> int:
        return len(self.prealloc) + len(self.transfer)

    def add(self, r: RemoteRoom) -> None:
        self.engine.scheduler.validate(r.request)
        r.client.add_room(r.room)
        self.prealloc[r.room] = r

    def abort(self, room: int, reason: str) -> RemoteRoom | None:
        r = self.prealloc.pop(room, None) or self.transfer.pop(room, None)
        if r is None:
            return None
        self._give_up(r, reason)
        return r

    def tick(self) -> list[RoomOutcome]:
        """One pass: free what became safe, admit preallocs, poll transfers."""
        alloc = self.engine.scheduler.allocator
        while not self._to_free.empty():
            alloc.free(self._to_free.get())
        self._admit()
        return self._poll()

    def _admit(self) -> None:
        sched = self.engine.scheduler
        page_size = self.engine.config.page_size
        for room, r in list(self.prealloc.items()):
            need = -(-r.request.num_prompt_tokens // page_size)
            if sched.allocator.num_free - sched.num_owed_pages < sched.worst_case_pages(r.request):
                return  # FIFO: nobody overtakes the head
            pages = sched.allocator.allocate(need)
            try:
                r.client.send_destination(room, pages)
            except TransferError:
                sched.allocator.free(pages)
                return  # no aux slot now: retry on a later tick
            r.pages = pages
            self.transfer[room] = self.prealloc.pop(room)

    def _poll(self) -> list[RoomOutcome]:
        out = []
        for room, r in list(self.transfer.items()):
            status = r.client.poll(room)
            if status is KVPoll.Success:
                del self.transfer[room]
                out.append(self._adopt(r))
            elif status is KVPoll.Failed:
                del self.transfer[room]
                reason = r.client.failure_reason(room)
                r.client.release(room)
                out.append(RoomOutcome(r, error=reason))
        return out

    def _adopt(self, r: RemoteRoom) -> RoomOutcome:
        """Commit a delivered room: check the echoed room id, append the first token."""
        row = r.client.commit(r.room)
        req, pages = r.request, r.pages or []
        if row.room != r.room:
            self.engine.scheduler.allocator.free(pages)
            return RoomOutcome(r, error=f"aux row names room {row.room}, expected {r.room}")
        req.page_ids = pages
        req.num_computed_tokens = req.num_prompt_tokens
        req.output_token_ids.append(row.first_token)
        req.output_logprobs.append(row.logprob)
        req.payload = RequestState(images=[], mrope_table=None, delta=row.mrope_delta,
                                   image_prefix=None, generator=make_generator(req.sampling.seed))
        reason = self._first_token_finishes(req)
        if reason is not None:
            req.finish_reason = reason
            self.engine.scheduler.allocator.free(pages)
            req.page_ids = []
            return RoomOutcome(r, finished=True)
        self.engine.scheduler.add(req)
        return RoomOutcome(r)

    def _first_token_finishes(self, req: Request) -> FinishReason | None:
        token, params = req.output_token_ids[-1], req.sampling
        eos = self.engine.model_config.eos_token_ids
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            return FinishReason.STOP
        if params.max_new_tokens <= 1:
            return FinishReason.LENGTH
        return None

    def _give_up(self, r: RemoteRoom, reason: str) -> None:
        r.client.abort(r.room, reason)  # now Failed, unless it was delivered a moment ago
        if r.client.poll(r.room) is KVPoll.Success:
            r.client.commit(r.room)
            self.engine.scheduler.allocator.free(r.pages or [])
            return
        r.client.release(r.room)  # its pages come back through free_later once safe
