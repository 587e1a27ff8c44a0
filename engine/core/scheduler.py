"""The pure-Python scheduler core: continuous batching with chunked prefill over token counters.

One step is ``schedule() -> (model runs the items) -> update(output, sampled)``. Each step closes
part of every running request's gap ``num_tokens - num_computed_tokens`` under a token budget:

* running requests first, in admission order: one token each when decoding, the next prompt chunk
  when still in chunked prefill;
* then waiting requests, FIFO, while the budget, ``max_num_seqs`` and the page reserve allow.

Admission is preemption-free. The scheduler keeps ``reserved`` (sum of the worst-case page counts
of running requests) and ``held`` (pages those requests hold), so ``owed = reserved - held`` is the
number of pages running requests may still need. A request is admitted only if
``allocator.num_free - owed`` covers its own worst case, so a running request never meets
:class:`OutOfPagesError`. Pages are still allocated lazily, only for the tokens being scheduled::

    page_ids:  [ p0 | p1 | p2 ]                  (allocated so far, contiguous when possible)
    tokens:    [ computed .......... | chunk ]   (schedule() allocates pages covering the chunk)
    worst:     ceil((prompt + max_new_tokens) / page_size) pages, reserved at admission

Prefix cache (``engine/core/prefix_cache.py``, optional): admission first looks up the longest
cached prefix of a fresh request's prompt; the request takes those pages (one reference each)
and starts with ``num_computed_tokens`` at the cached length. Cached pages no request holds are
*evictable*, and the scheduler counts ``available = allocator.num_free + evictable``: admission
asks ``available - owed`` to cover the request's worst case (less the pages it got from the
cache, counting the evictable ones it pins as no longer available), and an allocation that finds
too few free pages evicts cached ones first, so the no-starvation guarantee above still holds.
Full blocks enter the cache as their KV completes (after each update, and when a request
finishes or is aborted); finishing frees the request's references, which may leave pages
cached-only (evictable) rather than free.

Batch rows: admission also gives a request a free row in ``[0, max_num_seqs)``
(``Request.batch_row``), the index of its state in the model runner's persistent batch
(``engine/runner/input_batch.py``); finishing or aborting it returns the row. So the rows held are
exactly the running requests' rows, and a row is reused only after its last holder finished.

State slots (hybrid models, optional ``state_slots``): admission also takes a free slot of the
linear-attention state pool (``Request.state_slot``) and waits, FIFO, while none is free;
finishing or aborting returns it, exactly once, with the request's pages. A decode node takes
a transfer's destination slot through :meth:`Scheduler.take_state_slot` (a *lent* slot, held by
the caller) and either frees it (:meth:`Scheduler.free_state_slot`) or hands it to the request it
adopts (``Request.state_slot`` set before :meth:`Scheduler.add`, which admission keeps). So the
slots held are exactly the scheduled requests' slots and the lent ones.

State checkpoints (hybrid models with a prefix cache, ``engine/core/state_checkpoints.py``): a
prompt's prefill chunks end at every checkpoint boundary inside the prompt (each ``interval``
tokens), and a chunk ending at one whose state is not kept yet reserves a checkpoint slot
(``ScheduledItem.save_to``), which :meth:`Scheduler.update` commits under the boundary's block
key. A request admitted with a prefix hit starts from the checkpoint at the hit's end
(``ScheduledItem.restore_from`` of its first chunk). The model runner copies both: restores
before the forward, saves after it.

No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.page_allocator import PageAllocator
from engine.core.prefix_cache import PrefixCache
from engine.core.request import FinishReason, Request, TopLogprobs
from engine.core.state_slots import StateSlotAllocator
from engine.errors import DuplicateRequestError, InvalidRequestError


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler. ``max_num_batched_tokens`` is the per-step token budget and so
    also the longest prefill chunk. ``vocab_size``, when given, bounds prompt and stop ids."""

    num_pages: int
    page_size: int
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None
    lookahead_tokens: int = 0  # speculative decoding writes KV this far past the last token

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")


@dataclass(slots=True, eq=False)
class ScheduledItem:
    """Compute tokens ``[start, start + num_tokens)`` of ``request`` this step.

    ``start == request.num_computed_tokens`` at schedule time; ``needs_sample`` is True iff the
    chunk ends at ``request.num_tokens`` (the logits of its last token are needed). Hybrid
    models with state checkpoints: ``restore_from`` is the checkpoint slot the request's state
    slot takes before the forward (its first chunk after a prefix hit), ``save_to`` the one
    its state slot is copied into after it (the chunk ends at a checkpoint boundary); -1 none.
    """

    request: Request
    start: int
    num_tokens: int
    needs_sample: bool
    restore_from: int = -1
    save_to: int = -1


@dataclass(slots=True)
class SchedulerOutput:
    """The items of one step, running requests first, then newly admitted ones."""

    items: list[ScheduledItem]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def num_samples(self) -> int:
        return sum(1 for item in self.items if item.needs_sample)

    def __len__(self) -> int:
        return len(self.items)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Scheduler core shared by prefill and decode nodes (see the module docstring).

    A request may arrive with ``num_computed_tokens > 0`` and ``page_ids`` already holding that KV
    (a decode node adopting transferred KV); the scheduler then owns and frees those pages too
    (such a request is not looked up in the prefix cache).
    """

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator,
                 prefix_cache: PrefixCache | None = None,
                 state_slots: StateSlotAllocator | None = None) -> None:
        if config.num_pages > allocator.num_pages:
            raise ValueError(
                f"SchedulerConfig.num_pages={config.num_pages} exceeds the allocator's "
                f"{allocator.num_pages} pages"
            )
        if prefix_cache is not None and (prefix_cache.allocator is not allocator
                                         or prefix_cache.page_size != config.page_size):
            raise ValueError("the prefix cache must share the scheduler's allocator and page size")
        self.config = config
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.state_slots = state_slots
        self._lent_slots = 0  # state slots taken by take_state_slot, not yet freed or adopted
        self._restores: dict[str, int] = {}  # admitted this step: the checkpoint slot to start from
        self._waiting: dict[str, Request] = {}  # FIFO by insertion order
        self._running: dict[str, Request] = {}  # admission order
        self._worst: dict[str, int] = {}  # request_id -> pages reserved at admission
        self._reserved = 0
        self._held = 0
        self._eos = frozenset(config.eos_token_ids)
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))  # pop() gives row 0 first
        self._initial_free = allocator.num_free

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_available_pages(self) -> int:
        """Free pages plus cached pages no request holds (evicted on demand)."""
        cache = self.prefix_cache
        return self.allocator.num_free + (cache.num_evictable if cache is not None else 0)

    @property
    def num_request_pages(self) -> int:
        """Pages held by requests (a page shared by several counts once; a cached page a
        request holds counts here, a cached-only page does not)."""
        return self.allocator.num_pages - self.num_available_pages

    @property
    def num_cached_only_pages(self) -> int:
        """Cached pages no request holds (evictable: not a leak)."""
        return self.prefix_cache.num_evictable if self.prefix_cache is not None else 0

    def take_pages(self, n: int, after: int | None = None) -> list[int]:
        """Allocate ``n`` pages (``PageAllocator.allocate``), evicting cached-only pages when too
        few are free; a decode node takes its transfer destinations through this too."""
        short = n - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.allocate(n, after=after)

    def free_pages(self, pages: list[int]) -> None:
        """Drop one reference on each of ``pages`` (taken by :meth:`take_pages` or from the
        prefix cache); cached pages left with only the cache's reference become evictable."""
        self.allocator.free(pages)
        if self.prefix_cache is not None:
            self.prefix_cache.release(pages)

    def take_state_slot(self) -> int:
        """Lend a free state slot (a decode's transfer destination); raises
        ``OutOfStateSlotsError`` when none is free, ``ValueError`` without a state pool."""
        if self.state_slots is None:
            raise ValueError("this scheduler has no state slots")
        slot = self.state_slots.allocate()
        self._lent_slots += 1
        return slot

    def free_state_slot(self, slot: int) -> None:
        """Give back a slot :meth:`take_state_slot` lent (never adopted by a request)."""
        if self.state_slots is None or self._lent_slots == 0:
            raise ValueError(f"state slot {slot} was not lent by this scheduler")
        self.state_slots.free(slot)
        self._lent_slots -= 1

    def disable_prefix_cache(self) -> None:
        """Stop caching: drop every cached block (requests keep their pages)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache = None

    @property
    def num_owed_pages(self) -> int:
        """Pages running requests may still allocate in the worst case."""
        return self._reserved - self._held

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def request_ids(self) -> list[str]:
        """Ids of every waiting and running request."""
        return [*self._waiting, *self._running]

    def get(self, request_id: str) -> Request | None:
        return self._running.get(request_id) or self._waiting.get(request_id)

    def worst_case_pages(self, request: Request) -> int:
        """Pages ``request`` can need at most: ceil((prompt + max_new_tokens) / page_size)."""
        total = request.num_prompt_tokens + request.sampling.max_new_tokens
        total += self.config.lookahead_tokens
        return max(cdiv(total, self.config.page_size), len(request.page_ids))

    # ---- admission -----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Validate ``request`` and queue it (FIFO). Raises :class:`InvalidRequestError`."""
        self.validate(request)
        if request.state_slot >= 0:  # a lent slot the request adopts
            self._lent_slots -= 1
        self._waiting[request.request_id] = request

    def validate(self, req: Request) -> None:
        """Raise :class:`InvalidRequestError` if :meth:`add` would refuse ``req``."""
        cfg = self.config
        rid = req.request_id
        if rid in self._waiting or rid in self._running:
            raise DuplicateRequestError(f"duplicate request id {rid!r}")
        if req.is_finished:
            raise InvalidRequestError(f"request {rid!r} is already finished")
        if req.batch_row != -1:
            raise InvalidRequestError(f"request {rid!r} already holds batch row {req.batch_row}")
        if req.state_slot >= 0 and (self.state_slots is None or self._lent_slots == 0
                                    or self.state_slots.is_free(req.state_slot)):
            raise InvalidRequestError(
                f"request {rid!r} holds state slot {req.state_slot}, which was not lent")
        if req.num_prompt_tokens == 0:
            raise InvalidRequestError(f"request {rid!r} has an empty prompt")
        req.sampling.validate(cfg.vocab_size)
        if req.sampling.resumed_tokens >= req.num_prompt_tokens:
            raise InvalidRequestError(
                f"resumed_tokens {req.sampling.resumed_tokens} must be less than the prompt's "
                f"{req.num_prompt_tokens} tokens")
        self._validate_prompt_ids(req)
        total = req.num_prompt_tokens + req.sampling.max_new_tokens
        if total > cfg.max_model_len:
            raise InvalidRequestError(
                f"prompt of {req.num_prompt_tokens} tokens + max_new_tokens "
                f"{req.sampling.max_new_tokens} = {total} exceeds max_model_len {cfg.max_model_len}"
            )
        worst = self.worst_case_pages(req)
        if worst > cfg.num_pages:
            raise InvalidRequestError(
                f"request {rid!r} may need {worst} KV pages but the pool has {cfg.num_pages}"
            )
        self._validate_counters(req)

    def _validate_prompt_ids(self, req: Request) -> None:
        vocab = self.config.vocab_size
        for tok in req.prompt_token_ids:
            if not isinstance(tok, int) or tok < 0 or (vocab is not None and tok >= vocab):
                raise InvalidRequestError(
                    f"request {req.request_id!r} has an invalid prompt token id {tok!r}"
                )

    def _validate_counters(self, req: Request) -> None:
        if req.num_output_tokens >= req.sampling.max_new_tokens:
            raise InvalidRequestError(
                f"request {req.request_id!r} already has {req.num_output_tokens} output tokens"
            )
        if not 0 <= req.num_computed_tokens < req.num_tokens:
            raise InvalidRequestError(
                f"request {req.request_id!r}: num_computed_tokens={req.num_computed_tokens} "
                f"must be in [0, num_tokens={req.num_tokens})"
            )
        if len(req.page_ids) < cdiv(req.num_computed_tokens, self.config.page_size):
            raise InvalidRequestError(
                f"request {req.request_id!r} holds {len(req.page_ids)} pages, too few for "
                f"{req.num_computed_tokens} computed tokens"
            )

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, prefill_only: bool = False) -> SchedulerOutput:
        """Pick this step's work and allocate the pages it writes (see the module docstring).

        ``prefill_only`` leaves decoding requests out (a speculative decoder runs them).
        """
        budget = self.config.max_num_batched_tokens
        page_size = self.config.page_size
        items: list[ScheduledItem] = []
        add = items.append
        checkpoints = self.prefix_cache.checkpoints if self.prefix_cache is not None else None
        for req in self._running.values():  # the hot loop: _schedule_chunk inlined
            if budget == 0:
                break
            start = req.num_computed_tokens
            prompt_len = len(req.prompt_token_ids)
            if prefill_only and start >= prompt_len:
                continue
            gap = prompt_len + len(req.output_token_ids) - start
            if gap > 0:
                n = gap if gap < budget else budget
                if checkpoints is not None and start < prompt_len:
                    budget -= self._schedule_chunk(req, start, n, gap, items)
                    continue
                if start + n > len(req.page_ids) * page_size:
                    self._allocate_pages(req, start + n)
                add(ScheduledItem(req, start, n, n == gap))
                budget -= n
        while budget > 0 and self._waiting and len(self._running) < self.config.max_num_seqs:
            req = next(iter(self._waiting.values()))
            if not self._try_admit(req):
                break  # FIFO: nobody overtakes the head of the queue
            if prefill_only and not req.is_prefill:
                continue  # admitted with its prompt already computed: the decoder runs it
            gap = req.num_tokens - req.num_computed_tokens
            budget -= self._schedule_chunk(req, req.num_computed_tokens, min(gap, budget), gap,
                                           items)
        return SchedulerOutput(items)

    def _try_admit(self, req: Request) -> bool:
        slots = self.state_slots
        if slots is not None and req.state_slot < 0 and slots.num_free == 0:
            return False
        worst = self.worst_case_pages(req)
        cache = self.prefix_cache
        hit: list[int] = []
        pinned = 0
        if cache is not None and not req.page_ids and req.num_computed_tokens == 0 \
                and req.sampling.prompt_logprobs is None:  # cached positions have no logits
            hit = cache.match(req)
            pinned = cache.num_pinned_by(hit)
        held = len(req.page_ids) + len(hit)
        if self.num_available_pages - pinned - self.num_owed_pages < worst - held:
            return False
        if cache is not None and not req.page_ids and req.num_computed_tokens == 0:
            cache.take(req, hit)
            if hit and cache.checkpoints is not None:
                self._restores[req.request_id] = cache.restore_slot(req, len(hit))
        del self._waiting[req.request_id]
        self._running[req.request_id] = req
        self._worst[req.request_id] = worst
        self._reserved += worst
        self._held += held
        req.batch_row = self._free_rows.pop()
        if slots is not None and req.state_slot < 0:
            req.state_slot = slots.allocate()
        return True

    def _schedule_chunk(
        self, req: Request, start: int, n: int, gap: int, items: list[ScheduledItem]
    ) -> int:
        """Schedule ``n`` of the ``gap`` tokens from ``start`` on, or fewer, up to the next state
        checkpoint boundary inside the prompt; returns how many."""
        restore, save = self._restores.pop(req.request_id, -1), -1
        cache = self.prefix_cache
        checkpoints = cache.checkpoints if cache is not None else None
        prompt_len = len(req.prompt_token_ids)
        if checkpoints is not None and start < prompt_len:
            assert cache is not None
            boundary = checkpoints.next_boundary(start)
            if boundary < prompt_len and start + n >= boundary and checkpoints.num_slots:
                n = boundary - start
                if cache.boundary_key(req, boundary // self.config.page_size) not in checkpoints:
                    reserved = checkpoints.reserve()
                    save = -1 if reserved is None else reserved
        if (start + n) > len(req.page_ids) * self.config.page_size:
            self._allocate_pages(req, start + n)
        items.append(ScheduledItem(req, start, n, n == gap, restore, save))
        return n

    def _allocate_pages(self, req: Request, end: int) -> None:
        missing = -(-end // self.config.page_size) - len(req.page_ids)
        if missing > 0:
            after = req.page_ids[-1] if req.page_ids else None
            req.page_ids.extend(self.take_pages(missing, after=after))
            self._held += missing

    def update(self, output: SchedulerOutput, sampled: list[tuple[int, float]],
               tops: Sequence[TopLogprobs | None] = ()) -> list[Request]:
        """Apply one step's results; return the requests that finished in this step.

        ``sampled`` holds one ``(token_id, logprob)`` per item with ``needs_sample``, in item
        order, and ``tops`` (when given, aligned with it) each token's alternatives, for the
        requests that asked for them. Items whose request was aborted after :meth:`schedule` are
        skipped.
        """
        if len(sampled) != output.num_samples:
            raise ValueError(
                f"got {len(sampled)} sampled tokens for {output.num_samples} items that need one"
            )
        finished: list[Request] = []
        samples = iter(sampled)
        alternatives = iter(tops) if tops else None
        eos = self._eos
        for item in output.items:
            req = item.request
            sample = next(samples) if item.needs_sample else None
            top = next(alternatives) if alternatives is not None and item.needs_sample else None
            if req.finish_reason is not None:
                continue
            if item.start != req.num_computed_tokens:
                raise ValueError(f"stale item for request {req.request_id!r}")
            req.num_computed_tokens += item.num_tokens
            if sample is None:
                continue
            token, params = sample[0], req.sampling
            # the common case, inlined: a token that stops nothing (see _append_token)
            if (len(req.output_token_ids) + 1 < params.max_new_tokens
                    and token not in params.stop_token_ids
                    and (params.ignore_eos or token not in eos)):
                req.output_token_ids.append(token)
                req.output_logprobs.append(sample[1])
                if top is not None:
                    req.output_top_logprobs.append(top)
            elif self._append_token(req, token, sample[1], top):
                finished.append(req)
        cache = self.prefix_cache
        if cache is not None:  # full blocks completed this step become shareable
            for item in output.items:
                if item.save_to >= 0:
                    self._commit_checkpoint(cache, item)
                if item.request.finish_reason is None:
                    cache.insert(item.request)
        return finished

    def _commit_checkpoint(self, cache: PrefixCache, item: ScheduledItem) -> None:
        """The forward copied ``item``'s state into its reserved checkpoint slot: keep it under
        the boundary's key (an aborted request's slot is only released)."""
        checkpoints = cache.checkpoints
        assert checkpoints is not None
        if item.request.finish_reason is not None:
            checkpoints.release(item.save_to)
            return
        end = item.start + item.num_tokens
        checkpoints.commit(cache.boundary_key(item.request, end // self.config.page_size),
                           item.save_to)

    def decoding(self) -> list[Request]:
        """Running requests past their prompt (a speculative decoder's batch)."""
        return [r for r in self._running.values() if not r.is_prefill]

    def grow(self, req: Request, end: int) -> None:
        """Allocate pages so a running ``req`` can hold KV for tokens ``[0, end)``; ``end`` may
        pass ``num_tokens`` by up to ``lookahead_tokens`` (speculative writes)."""
        limit = self._worst[req.request_id] * self.config.page_size
        if end > limit:
            raise ValueError(f"request {req.request_id!r}: {end} tokens exceed its reserve")
        self._allocate_pages(req, end)

    def commit(self, req: Request, computed: int, tokens: list[tuple[int, float]],
               tops: Sequence[TopLogprobs | None] = ()) -> bool:
        """Record a speculative round: KV now covers ``computed`` tokens and ``tokens`` were
        accepted (in order; ``tops``, when given, their alternatives). Stops at a stop token or
        ``max_new_tokens``; returns True when the request finished (its pages are then
        freed)."""
        if not req.num_computed_tokens < computed <= req.num_tokens + len(tokens) - 1:
            raise ValueError(f"request {req.request_id!r}: bad computed count {computed}")
        req.num_computed_tokens = computed
        alternatives = list(tops) or [None] * len(tokens)
        done = any(self._append_token(req, tok, lp, top)
                   for (tok, lp), top in zip(tokens, alternatives, strict=True))
        if not done and self.prefix_cache is not None:
            self.prefix_cache.insert(req)
        return done

    def _append_token(self, req: Request, token: int, logprob: float,
                      top: TopLogprobs | None = None) -> bool:
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        if top is not None:
            req.output_top_logprobs.append(top)
        params = req.sampling
        if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos):
            reason = FinishReason.STOP
        elif len(req.output_token_ids) >= params.max_new_tokens:
            reason = FinishReason.LENGTH
        else:
            return False
        self._finish(req, reason)
        return True

    # ---- finishing -----------------------------------------------------------------------------

    def abort(self, request_id: str) -> Request | None:
        """Finish a waiting or running request with ABORT and free its pages; None if unknown."""
        req = self.get(request_id)
        if req is not None:
            self._finish(req, FinishReason.ABORT)
        return req

    def _finish(self, req: Request, reason: FinishReason) -> None:
        rid = req.request_id
        if self._running.pop(rid, None) is not None:
            self._reserved -= self._worst.pop(rid)
            self._held -= len(req.page_ids)
            self._free_rows.append(req.batch_row)
            req.batch_row = -1
        else:
            del self._waiting[rid]
        if self.state_slots is not None and req.state_slot >= 0:
            self.state_slots.free(req.state_slot)
            req.state_slot = -1
        req.finish_reason = reason
        cache = self.prefix_cache
        if cache is not None and req.page_ids:
            cache.insert(req)  # its computed KV is valid, finished or aborted
        pages, req.page_ids = req.page_ids, []
        self.free_pages(pages)

    # ---- checks --------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the accounting invariants (O(requests + pages); for tests)."""
        running = list(self._running.values())
        assert self._held == sum(len(r.page_ids) for r in running)
        assert self._reserved == sum(self._worst[r.request_id] for r in running)
        assert set(self._worst) == set(self._running)
        assert self.num_available_pages >= self.num_owed_pages, "running requests could starve"
        rows = sorted([r.batch_row for r in running] + self._free_rows)
        assert rows == list(range(self.config.max_num_seqs)), "batch rows leaked or shared"
        if self.state_slots is not None:
            held = [r.state_slot for r in running]
            held += [r.state_slot for r in self._waiting.values() if r.state_slot >= 0]
            assert len(set(held)) == len(held), "a state slot is shared"
            assert len(held) + self._lent_slots == self.state_slots.num_used, \
                "state slots leaked"
        for req in running:
            assert not req.is_finished
            assert len(req.page_ids) >= cdiv(req.num_computed_tokens, self.config.page_size)
            assert len(req.page_ids) <= self._worst[req.request_id]
        self.allocator.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check()

    def check_no_leaks(self) -> None:
        """Assert the scheduler is empty and every page it took is back: free in the
        allocator, or cached-only (evictable) in the prefix cache, which is not a leak."""
        assert not self._waiting and not self._running, "requests left in the scheduler"
        assert self._reserved == 0 and self._held == 0 and not self._worst
        assert len(self._free_rows) == self.config.max_num_seqs, "batch rows leaked"
        if self.state_slots is not None:
            assert self.state_slots.num_used == 0 and self._lent_slots == 0, \
                "state slots leaked"
        assert self.num_available_pages == self._initial_free, "KV pages leaked"
        self.allocator.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check()
            assert self.prefix_cache.num_evictable == self.prefix_cache.num_cached_pages
            checkpoints = self.prefix_cache.checkpoints
            assert checkpoints is None or checkpoints.num_reserved == 0, \
                "state checkpoint slots left reserved"
