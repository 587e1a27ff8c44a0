"""The decode node's disaggregated queues: prealloc and transfer.

A remote room moves through:

* **prealloc**: waits until the pool can hold its prompt's pages *and* the scheduler can still
  finish every running request (``available - owed >= worst case of this request``, less the
  pages its prefix-cache hit brings); then its prompt pages are taken and sent to the prefill as
  the room's destination.

  Delta transfer: with the engine's prefix cache (``engine/core/prefix_cache.py``) the room first
  looks up the longest cached prefix of its prompt here and pins those pages
  (``RemoteRoom.cached``); the destination then covers only the pages after them and tells the
  prefill how many it holds (``Destination.cached_pages``), so their KV is never sent. At
  adoption the request takes the cached pages followed by the transferred ones; a room that
  fails returns its cached pages at once (no prefill ever writes them).
* **transfer**: polled each loop iteration. On ``Success`` the aux row is committed, its echoed
  room id checked, and the request joins the scheduler with the prompt computed and the first
  token appended (or finishes at once when that token ends it). On ``Failed`` the room is
  released to the bootstrap client, which frees its pages once the prefill can no longer write
  into them (through :meth:`RemoteQueues.free_later`, drained by the engine thread).

A room prefilled by a pipeline (several prefill stages, one client each, in stage order) sends
the same destination pages to every stage; only the last stage's client holds the aux slot. A
decode with TP ranks has one client per rank and stage (rank 0's last in each stage), each
taking the same pages, as stages do. The
room succeeds when every stage says ``Success`` and fails when any stage fails (the others are
aborted). Its pages are freed once, after every stage that took them is quiet: the clients each
hand them back through :meth:`free_later`, counted in ``_shares``.

A hybrid model's room also takes a state slot at prealloc (lent by the scheduler,
:meth:`engine.core.scheduler.Scheduler.take_state_slot`), sent with the pages as the
destination of the prompt's final linear-attention states. The adopted request holds it from
then on; a room that fails gives it back with its pages, once no prefill can write into it.

Every method except :meth:`free_later` runs on the engine thread with the loop lock held.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.request import FinishReason, Request, TopLogprobs
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.multimodal.inputs import RequestState
from engine.sampling.sampler import make_generator
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.errors import TransferError
from transfer.status import KVPoll


@dataclass
class RemoteRoom:
    room: int
    request: Request  # prompt and sampling; no pages until prealloc
    # one per prefill stage and TP rank of this decode (decode_node.clients), in stage order;
    # the last one holds the aux slot
    clients: list[DecodeBootstrapClient]
    pages: list[int] | None = None  # the transfer's destination pages
    cached: list[int] = field(default_factory=list)  # pinned prefix-cache pages before them
    holding: list[DecodeBootstrapClient] = field(default_factory=list)  # took the pages
    state_slot: int = -1  # a hybrid model's destination state slot (lent by the scheduler)

    @property
    def aux_client(self) -> DecodeBootstrapClient:
        return self.clients[-1]


@dataclass(frozen=True)
class RoomOutcome:
    """A room that left the remote queues: adopted (``request`` runs now), finished by its
    first token, or failed (``error``)."""

    room: RemoteRoom
    error: str | None = None
    finished: bool = False


Seed = Callable[[Request, torch.Tensor], None]


class RemoteQueues:
    def __init__(self, engine: LLMEngine, seed: Seed | None = None) -> None:
        """``seed``: a speculative decoder's hook, given each adopted request and the draft
        feature of its aux row."""
        self.engine = engine
        self._seed = seed
        self.prealloc: dict[int, RemoteRoom] = {}
        self.transfer: dict[int, RemoteRoom] = {}
        self._to_free: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self._shares: dict[tuple[int, ...], int] = {}  # pages of a failed pipeline room: holders
        # pages of given-up rooms not yet back, with the state slot that comes back with them
        self._owed: dict[tuple[int, ...], int] = {}
        self.cached_pages_hit = 0  # prompt pages rooms found in the prefix cache (not sent)

    def free_later(self, pages: list[int]) -> None:
        """Bootstrap-client callback (any thread): pages that are safe to reuse."""
        self._to_free.put(pages)

    def __contains__(self, room: int) -> bool:
        return room in self.prealloc or room in self.transfer

    @property
    def num_rooms(self) -> int:
        return len(self.prealloc) + len(self.transfer)

    @property
    def active(self) -> bool:
        """Whether :meth:`tick` has work: live rooms, or given-up rooms' pages still to free."""
        return self.num_rooms > 0 or bool(self._owed)

    def add(self, r: RemoteRoom) -> None:
        self.engine.scheduler.validate(r.request)
        added: list[DecodeBootstrapClient] = []
        try:
            for c in r.clients:
                c.add_room(r.room)
                added.append(c)
        except Exception:
            for c in added:
                c.abort(r.room, "room refused by another prefill stage")
                c.release(r.room)
            raise
        self.prealloc[r.room] = r

    def abort(self, room: int, reason: str) -> RemoteRoom | None:
        r = self.prealloc.pop(room, None) or self.transfer.pop(room, None)
        if r is None:
            return None
        self._give_up(r, reason)
        return r

    def tick(self) -> list[RoomOutcome]:
        """One pass: free what became safe, admit preallocs, poll transfers."""
        sched = self.engine.scheduler
        while not self._to_free.empty():
            pages = self._to_free.get()
            key = tuple(pages)
            left = self._shares.get(key, 1) - 1
            if left > 0:
                self._shares[key] = left
                continue
            self._shares.pop(key, None)
            slot = self._owed.pop(key, -1)
            sched.free_pages(pages)
            if slot >= 0:
                sched.free_state_slot(slot)
        self._admit()
        return self._poll()

    def _admit(self) -> None:
        sched = self.engine.scheduler
        page_size = self.engine.config.page_size
        cache = sched.prefix_cache
        for room, r in list(self.prealloc.items()):
            need = -(-r.request.num_prompt_tokens // page_size)
            hit = cache.match(r.request, kv_only=True) if cache is not None else []
            pinned = cache.num_pinned_by(hit) if cache is not None else 0
            available = sched.num_available_pages - pinned - sched.num_owed_pages
            if available < sched.worst_case_pages(r.request) - len(hit):
                return  # FIFO: nobody overtakes the head
            slots = sched.state_slots
            if slots is not None and slots.num_free == 0:
                return  # a hybrid model's states need a slot here too
            if cache is not None and hit:
                cache.pin(hit)  # before taking pages, so that no eviction takes them
            pages = sched.take_pages(need - len(hit))
            slot = sched.take_state_slot() if slots is not None else -1
            try:
                r.aux_client.send_destination(room, pages, cached_pages=len(hit),
                                              state_slot=slot)
            except TransferError:
                sched.free_pages(pages + hit)
                if slot >= 0:
                    sched.free_state_slot(slot)
                return  # no aux slot now: retry on a later tick
            r.pages, r.cached, r.state_slot = pages, hit, slot
            self.cached_pages_hit += len(hit)
            r.holding = [r.aux_client]
            for c in r.clients[:-1]:  # earlier stages: same pages, no aux row
                try:
                    c.send_destination(room, pages, aux=False, cached_pages=len(hit),
                                       state_slot=slot)
                except TransferError:
                    pass  # the room failed on that stage; _poll fails the whole room
                else:
                    r.holding.append(c)
            self.transfer[room] = self.prealloc.pop(room)

    def _poll(self) -> list[RoomOutcome]:
        out = []
        for room, r in list(self.transfer.items()):
            statuses = [c.poll(room) for c in r.clients]
            if all(s is KVPoll.Success for s in statuses):
                del self.transfer[room]
                out.append(self._adopt(r))
            elif KVPoll.Failed in statuses:
                del self.transfer[room]
                bad = r.clients[statuses.index(KVPoll.Failed)]
                reason = bad.failure_reason(room)
                self._give_up(r, reason)
                out.append(RoomOutcome(r, error=reason))
        return out

    def _adopt(self, r: RemoteRoom) -> RoomOutcome:
        """Commit a delivered room: check the echoed room id, append the first token."""
        for c in r.clients[:-1]:
            c.commit_without_aux(r.room)
        row = r.aux_client.commit(r.room)
        req, pages, sched = r.request, r.pages or [], self.engine.scheduler
        refusal = (f"aux row names room {row.room}, expected {r.room}" if row.room != r.room
                   else self._grammar_refusal(req, row.first_token))
        if refusal is not None:
            sched.free_pages(r.cached + pages)
            self._free_slot(r)
            return RoomOutcome(r, error=refusal)
        if sched.prefix_cache is not None:
            sched.prefix_cache.take(req, r.cached, pinned=True)
        req.page_ids = r.cached + pages
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = row.cached_tokens  # compute the prefill's cache saved
        req.output_token_ids.append(row.first_token)
        req.output_logprobs.append(row.logprob)
        if row.top is not None and req.sampling.top_logprobs:
            req.output_top_logprobs.append(TopLogprobs(*row.top))
        req.payload = RequestState(images=[], mrope_table=None, delta=row.mrope_delta,
                                   image_prefix=None, generator=make_generator(req.sampling.seed,
                                                                          self.engine.device))
        reason = self._first_token_finishes(req)
        if reason is not None:
            req.finish_reason = reason
            if sched.prefix_cache is not None:
                sched.prefix_cache.insert(req)  # its prompt's KV is whole: keep it for others
            sched.free_pages(req.page_ids)
            req.page_ids = []
            self._free_slot(r)
            return RoomOutcome(r, finished=True)
        req.state_slot, r.state_slot = r.state_slot, -1  # the request adopts the states
        self.engine.scheduler.add(req)
        if self._seed is not None:
            self._seed(req, torch.tensor(row.hidden, dtype=torch.float32))
        return RoomOutcome(r)

    def _grammar_refusal(self, req: Request, token: int) -> str | None:
        """Why the prefill's first ``token`` cannot start ``req``'s constrained output (a
        prefill that did not mask it), or None; ``req``'s grammar has then accepted it."""
        if req.sampling.structured_output is None:
            return None
        try:
            self.engine.structured.matcher(req).replay([token])
        except InvalidRequestError as exc:
            return f"the prefill's first token breaks the request's grammar: {exc}"
        return None

    def _first_token_finishes(self, req: Request) -> FinishReason | None:
        token, params = req.output_token_ids[-1], req.sampling
        eos = self.engine.model_config.eos_token_ids
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            return FinishReason.STOP
        if params.max_new_tokens <= 1:
            return FinishReason.LENGTH
        return None

    def _free_slot(self, r: RemoteRoom) -> None:
        """Give back the room's lent state slot (no prefill writes it any more)."""
        if r.state_slot >= 0:
            self.engine.scheduler.free_state_slot(r.state_slot)
            r.state_slot = -1

    def _give_up(self, r: RemoteRoom, reason: str) -> None:
        """Fail the room on every stage; its pages come back once every holder is quiet (its
        pinned cached pages at once: no prefill writes them)."""
        sched = self.engine.scheduler
        sched.free_pages(r.cached)
        r.cached = []
        released = 0
        for c in r.clients:
            c.abort(r.room, reason)  # now Failed, unless it was delivered a moment ago
            if c.poll(r.room) is KVPoll.Success:
                if c is r.aux_client:
                    c.commit(r.room)
                else:
                    c.commit_without_aux(r.room)
                continue
            released += c in r.holding
            c.release(r.room)  # a holder hands the pages to free_later once safe
        if r.pages:
            if released == 0:
                sched.free_pages(r.pages)
                self._free_slot(r)
                return
            # the prefill may still write the slot too: it comes back with the pages
            self._owed[tuple(r.pages)], r.state_slot = r.state_slot, -1
            if released > 1:
                self._shares[tuple(r.pages)] = released
