"""State slots a decode lends to its transfers (a hybrid model's destination slots): lent, then
freed or adopted by the request the transfer delivers, counted in the invariants and the leak
check, never shared, never freed twice."""

from __future__ import annotations

import pytest

from engine.core.page_allocator import PageAllocator
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.state_slots import StateSlotAllocator
from engine.errors import InvalidRequestError, OutOfStateSlotsError
from tests.engine.core.test_scheduler import make_request, run_to_completion, step


def make(num_slots: int = 2) -> tuple[Scheduler, PageAllocator]:
    cfg = SchedulerConfig(num_pages=64, page_size=4, max_model_len=4096, max_num_seqs=num_slots)
    alloc = PageAllocator(64)
    return Scheduler(cfg, alloc, state_slots=StateSlotAllocator(num_slots)), alloc


def delivered(alloc: PageAllocator, slot: int) -> Request:
    """A request as a decode adopts it: prompt computed into pages, first token, ``slot``."""
    req = make_request(prompt_len=9, max_new=3)
    req.page_ids = alloc.allocate(3)
    req.num_computed_tokens = 9
    req.output_token_ids.append(42)
    req.output_logprobs.append(-0.1)
    req.state_slot = slot
    return req


def test_an_adopted_request_keeps_its_lent_slot() -> None:
    sched, alloc = make()
    slot = sched.take_state_slot()
    sched.check_invariants()  # lent: held by nobody in the scheduler, counted
    req = delivered(alloc, slot)
    sched.add(req)
    sched.check_invariants()
    out, _ = step(sched)
    assert req.state_slot == slot and [i.start for i in out.items] == [9]
    run_to_completion(sched)
    assert req.state_slot == -1
    sched.check_no_leaks()


def test_a_lent_slot_blocks_admission_until_freed() -> None:
    sched, _ = make(num_slots=1)
    slot = sched.take_state_slot()
    with pytest.raises(OutOfStateSlotsError):
        sched.take_state_slot()
    with pytest.raises(AssertionError, match="state slots leaked"):
        sched.check_no_leaks()  # a lent slot is held
    local = make_request()
    sched.add(local)
    out, _ = step(sched)
    assert out.items == [] and local.state_slot == -1  # waits: the only slot is lent
    sched.free_state_slot(slot)
    run_to_completion(sched)
    sched.check_no_leaks()


def test_an_adopted_request_aborted_while_waiting_returns_its_slot() -> None:
    sched, alloc = make()
    req = delivered(alloc, sched.take_state_slot())
    sched.add(req)
    assert sched.abort(req.request_id) is req
    assert req.state_slot == -1
    sched.check_invariants()
    sched.check_no_leaks()


def test_slots_that_were_not_lent_are_refused() -> None:
    sched, alloc = make()
    with pytest.raises(InvalidRequestError, match="state slot 1, which was not lent"):
        sched.add(delivered(alloc, 1))
    with pytest.raises(ValueError, match="was not lent"):
        sched.free_state_slot(0)
    slot = sched.take_state_slot()
    sched.free_state_slot(slot)
    with pytest.raises(ValueError, match="was not lent"):
        sched.free_state_slot(slot)  # freed twice
    plain = Scheduler(SchedulerConfig(num_pages=8, page_size=4, max_model_len=64),
                      PageAllocator(8))
    with pytest.raises(ValueError, match="no state slots"):
        plain.take_state_slot()
