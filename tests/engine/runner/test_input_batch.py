"""The persistent batch (engine/runner/input_batch.py) and the scheduler's batch rows.

Every gathered value is checked against its definition computed the slow way from the requests
themselves: token ids from ``all_token_ids``, slots through ``kv_cache.slot_of`` (the one place a
slot is defined), page tables from ``page_ids``.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.builtin.tiny_model import write_tiny_model
from engine.config import EngineConfig
from engine.core.page_allocator import PageAllocator
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.kv.pool import slot_of
from engine.llm_engine import LLMEngine
from engine.multimodal.inputs import RequestState
from engine.runner.input_batch import (
    InputBatch,
    StepInputs,
    packed_copy,
    to_device,
    token_positions,
)

PS = 4


def _request(rid: str, prompt_len: int, new: int, delta: int = 0) -> Request:
    state = RequestState(images=[], mrope_table=None, delta=delta, image_prefix=None)
    return Request(rid, list(range(3, 3 + prompt_len)),
                   SamplingParams(max_new_tokens=new, ignore_eos=True), payload=state)


def _scheduler(max_seqs: int = 4, budget: int = 7) -> Scheduler:
    cfg = SchedulerConfig(num_pages=64, page_size=PS, max_model_len=64, max_num_seqs=max_seqs,
                          max_num_batched_tokens=budget)
    return Scheduler(cfg, PageAllocator(64))


def _expected(out: SchedulerOutput) -> dict[str, list[int]]:
    ids, pos, deltas, slots, sample = [], [], [], [], []
    for it in out.items:
        req = it.request
        state = req.payload
        assert isinstance(state, RequestState)
        for p in range(it.start, it.start + it.num_tokens):
            ids.append(req.all_token_ids[p])
            pos.append(p)
            deltas.append(state.delta)
            slots.append(slot_of(req.page_ids[p // PS], PS, p % PS))
        if it.needs_sample:
            sample.append(len(ids) - 1)
    return {"ids": ids, "pos": pos, "deltas": deltas, "slots": slots, "sample": sample}


def _check_step(step: StepInputs, out: SchedulerOutput) -> None:
    want = _expected(out)
    assert step.input_ids.tolist() == want["ids"]
    assert step.positions.tolist() == want["pos"]
    assert step.deltas.tolist() == want["deltas"]
    rows = step.sample_rows
    sampled = list(range(len(want["ids"])))[rows] if isinstance(rows, slice) else rows.tolist()
    assert sampled == want["sample"]
    att = step.attention
    assert att.slot_mapping.tolist() == want["slots"]
    q_lens = [it.num_tokens for it in out.items]
    kv_lens = [it.start + it.num_tokens for it in out.items]
    assert att.q_lens.tolist() == q_lens and att.kv_lens.tolist() == kv_lens
    assert att.q_starts.tolist() == [0, *np.cumsum(q_lens).tolist()]
    assert (att.max_q, att.max_kv) == (max(q_lens), max(kv_lens))
    assert att.page_table.dtype == torch.int32
    assert att.page_table.shape == (len(out.items), -(-max(kv_lens) // PS))
    for row, it in zip(att.page_table.tolist(), out.items, strict=True):
        used = -(-(it.start + it.num_tokens) // PS)
        assert row[:used] == it.request.page_ids[:used]


def _sample_all(out: SchedulerOutput, rng: random.Random) -> list[tuple[int, float]]:
    return [(rng.randrange(3, 40), 0.0) for it in out.items if it.needs_sample]


def test_steps_match_the_requests_through_prefill_decode_aborts_and_row_reuse() -> None:
    rng = random.Random(0)
    sched, batch = _scheduler(), InputBatch(PS)
    live: list[Request] = []
    for step in range(40):
        if step % 3 == 0 and len(live) < 6:
            req = _request(f"r{step}", rng.randrange(1, 12), rng.randrange(1, 8),
                           delta=rng.randrange(-3, 4))
            sched.add(req)
            live.append(req)
        out = sched.schedule()
        sched.check_invariants()
        if not out.items:
            continue
        _check_step(batch.prepare(out.items), out)
        if step % 7 == 6 and live:  # an abort after the forward: update skips its item
            sched.abort(rng.choice(live).request_id)
        sched.update(out, _sample_all(out, rng))
        live = [r for r in live if not r.is_finished]
        running = [r for r in live if r.batch_row >= 0]
        batch.check(running)
    while sched.has_unfinished():
        out = sched.schedule()
        _check_step(batch.prepare(out.items), out)
        sched.update(out, _sample_all(out, rng))
    sched.check_no_leaks()


def test_rows_are_given_at_admission_and_taken_back_at_finish_or_abort() -> None:
    sched = _scheduler(max_seqs=2, budget=32)
    a, b, c = _request("a", 3, 1), _request("b", 3, 5), _request("c", 3, 5)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()  # a and b admitted, c waits for a row
    assert sorted([a.batch_row, b.batch_row]) == [0, 1] and c.batch_row == -1
    sched.update(out, [(7, 0.0), (7, 0.0)])  # a finishes (one new token)
    assert a.batch_row == -1
    sched.schedule()
    assert c.batch_row >= 0 and c.batch_row != b.batch_row  # c took a's row
    sched.abort("b")
    assert b.batch_row == -1
    sched.check_invariants()
    sched.abort("c")
    sched.check_no_leaks()


def test_a_new_holder_of_a_row_never_sees_the_old_holders_pages() -> None:
    sched, batch = _scheduler(max_seqs=1, budget=32), InputBatch(PS)
    old = _request("old", 10, 1, delta=5)
    sched.add(old)
    out = sched.schedule()
    batch.prepare(out.items)
    sched.update(out, [(9, 0.0)])  # finished: row 0 free again
    new = _request("new", 2, 3)
    sched.add(new)
    out = sched.schedule()
    assert new.batch_row == 0
    step = batch.prepare(out.items)
    _check_step(step, out)
    assert step.deltas.tolist() == [0, 0]
    batch.check([new])


def test_decode_steps_of_the_same_shape_reuse_their_tensors() -> None:
    sched, batch = _scheduler(budget=32), InputBatch(PS)
    reqs = [_request(f"r{i}", 2 + i, 20) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    sched.update(out, [(5, 0.0)] * 3)
    seen: list[torch.Tensor] = []
    for _ in range(6):  # page boundaries pass at different steps for each request
        out = sched.schedule()
        step = batch.prepare(out.items)
        _check_step(step, out)  # refilled in place, still right
        seen.append(step.input_ids)
        sched.update(out, [(6, 0.0)] * 3)
    # the same shape twice in a row: the same staged tensors
    assert any(a is b for a, b in zip(seen, seen[1:], strict=False))


def test_bad_requests_are_refused() -> None:
    batch = InputBatch(PS)
    stray = _request("stray", 3, 1)
    with pytest.raises(ValueError, match="holds no batch row"):
        batch.rows([stray], [3])
    sched = _scheduler()
    req = _request("short", 3, 4)
    sched.add(req)
    sched.schedule()  # one page for 3 tokens
    with pytest.raises(ValueError, match="too few for 9 tokens"):
        batch.rows([req], [9])
    with pytest.raises(ValueError, match="page_size"):
        InputBatch(0)
    sched.abort("short")
    with pytest.raises(Exception, match="batch row"):
        held = _request("held", 3, 1)
        held.batch_row = 3
        sched.add(held)


def test_token_positions_and_packed_copy() -> None:
    item, pos = token_positions([5, 0, 9], [2, 3, 1])
    assert item.tolist() == [0, 0, 1, 1, 1, 2] and pos.tolist() == [5, 6, 0, 1, 2, 9]
    arrays: list[np.ndarray] = [np.arange(5, dtype=np.int64),
                                np.arange(6, dtype=np.int32).reshape(2, 3),
                                np.array([], dtype=np.int64),
                                np.array([0.5, 1.5, 2.5], dtype=np.float32)]
    packed = packed_copy(arrays, torch.device("cpu"))
    plain = to_device(arrays, torch.device("cpu"))
    for a, p, t in zip(arrays, packed, plain, strict=True):
        assert p.dtype == t.dtype and p.shape == t.shape and torch.equal(p, t)
        assert p.tolist() == a.tolist()


def test_engine_rows_follow_the_running_requests() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(write_tiny_model(Path(tmp) / "tiny"),
                           EngineConfig(num_pages=64, page_size=PS, max_num_seqs=3,
                                        max_num_batched_tokens=16))
        reqs = [engine.add_request(list(range(4, 4 + n)),
                                   sampling=SamplingParams(max_new_tokens=m, ignore_eos=True))
                for n, m in ((9, 4), (3, 7), (5, 2), (2, 5))]
        for i in range(30):
            if i == 3:
                engine.abort(reqs[1].request_id)
            if not engine.scheduler.has_unfinished():
                break
            engine.step()
            engine.scheduler.check_invariants()
            running = [r for r in reqs if r.batch_row >= 0]
            engine.runner.batch.check(running)
        engine.scheduler.check_no_leaks()
        assert [len(r.output_token_ids) for r in reqs] == [4, len(reqs[1].output_token_ids), 2, 5]
