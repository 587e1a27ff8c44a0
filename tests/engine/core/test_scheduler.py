"""Scheduler core as protocol traces: (a) schedule, (b) fake model step, (c) update; each trace ends
with a leak check. Property tests run random workloads on pools too small to hold everything."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.page_allocator import PageAllocator
from engine.core.request import FinishReason, Request, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.errors import DuplicateRequestError, InvalidRequestError

_ids = itertools.count()


def make_scheduler(
    num_pages: int = 64, page_size: int = 4, **kw: object
) -> tuple[Scheduler, PageAllocator]:
    kw.setdefault("max_model_len", 4096)
    cfg = SchedulerConfig(num_pages=num_pages, page_size=page_size, **kw)  # type: ignore[arg-type]
    alloc = PageAllocator(num_pages)
    return Scheduler(cfg, alloc), alloc


def make_request(prompt_len: int = 10, max_new: int = 4, **sampling: object) -> Request:
    params = SamplingParams(max_new_tokens=max_new, **sampling)  # type: ignore[arg-type]
    return Request(f"r{next(_ids)}", list(range(1, prompt_len + 1)), params)


TokenFn = Callable[[Request], int]


def step(
    sched: Scheduler, token_fn: TokenFn = lambda r: 7
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake model that samples ``token_fn(request)``."""
    out = sched.schedule()
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    for item in out.items:
        req = item.request
        assert item.start == req.num_computed_tokens
        assert item.needs_sample == (item.start + item.num_tokens == req.num_tokens)
        assert len(req.page_ids) * sched.config.page_size >= item.start + item.num_tokens
    sampled = [(token_fn(i.request), -0.25) for i in out.items if i.needs_sample]
    return out, sched.update(out, sampled)


def run_to_completion(sched: Scheduler, token_fn: TokenFn = lambda r: 7, limit: int = 10_000):
    finished: list[Request] = []
    for _ in range(limit):
        if not sched.has_unfinished():
            return finished
        finished += step(sched, token_fn)[1]
        sched.check_invariants()
    raise AssertionError("workload did not finish")


# ---- traces --------------------------------------------------------------------------------------


def test_prefill_then_decode_trace() -> None:
    sched, alloc = make_scheduler(page_size=4)
    req = make_request(prompt_len=10, max_new=3)
    sched.add(req)
    # STEP 1: whole prompt, sample the first token
    out, done = step(sched)
    assert [(i.start, i.num_tokens, i.needs_sample) for i in out.items] == [(0, 10, True)]
    assert req.page_ids == [0, 1, 2] and req.num_computed_tokens == 10 and not done
    assert req.num_tokens == req.num_computed_tokens + 1 and not req.is_prefill
    # STEP 2: decode token 10 (page 2 still has room)
    out, done = step(sched)
    assert [(i.start, i.num_tokens) for i in out.items] == [(10, 1)]
    assert req.page_ids == [0, 1, 2]
    # STEP 3: decode token 11, third output token reaches max_new_tokens
    out, done = step(sched)
    assert done == [req] and req.finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == [7, 7, 7] and req.output_logprobs == [-0.25] * 3
    assert req.page_ids == [] and alloc.num_free == 64
    sched.check_no_leaks()


def test_decode_allocates_one_page_at_page_boundary_contiguously() -> None:
    sched, _ = make_scheduler(page_size=4)
    req = make_request(prompt_len=8, max_new=6)
    sched.add(req)
    step(sched)
    assert req.page_ids == [0, 1]
    step(sched)  # computes token 8 -> needs a third page
    assert req.page_ids == [0, 1, 2]
    run_to_completion(sched)
    sched.check_no_leaks()


def test_chunked_prefill_respects_budget() -> None:
    sched, _ = make_scheduler(page_size=4, max_num_batched_tokens=8)
    req = make_request(prompt_len=20, max_new=2)
    sched.add(req)
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        chunks += [(i.start, i.num_tokens, i.needs_sample) for i in out.items]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.page_ids == [0, 1, 2, 3, 4] and req.num_output_tokens == 1
    run_to_completion(sched)
    sched.check_no_leaks()


def test_running_first_then_new_requests_chunked_into_leftover_budget() -> None:
    sched, _ = make_scheduler(page_size=4, max_num_batched_tokens=10)
    a, b = make_request(prompt_len=6, max_new=5), make_request(prompt_len=30, max_new=2)
    sched.add(a)
    step(sched)
    sched.add(b)
    out, _ = step(sched)
    assert [(i.request, i.start, i.num_tokens) for i in out.items] == [(a, 6, 1), (b, 0, 9)]
    out, _ = step(sched)
    assert [(i.request, i.start, i.num_tokens) for i in out.items] == [(a, 7, 1), (b, 9, 9)]
    run_to_completion(sched)
    sched.check_no_leaks()


def test_max_num_seqs_limits_running() -> None:
    sched, _ = make_scheduler(max_num_seqs=2)
    reqs = [make_request(prompt_len=3, max_new=2) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    out, _ = step(sched)
    assert [i.request for i in out.items] == reqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 1
    done = run_to_completion(sched)
    assert set(done) == set(reqs)
    sched.check_no_leaks()


def test_admission_reserves_worst_case_but_allocates_lazily() -> None:
    # worst case of each request: ceil((4 + 8) / 4) = 3 pages; pool of 5 fits only one
    sched, alloc = make_scheduler(num_pages=5, page_size=4)
    a, b = make_request(prompt_len=4, max_new=8), make_request(prompt_len=4, max_new=8)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert [i.request for i in out.items] == [a]
    assert a.page_ids == [0] and alloc.num_free == 4 and sched.num_owed_pages == 2
    while not a.is_finished:
        out, _ = step(sched)
        assert b not in [i.request for i in out.items]
    out, _ = step(sched)
    assert [i.request for i in out.items] == [b]
    run_to_completion(sched)
    sched.check_no_leaks()


def test_fifo_head_of_line_is_not_overtaken() -> None:
    sched, _ = make_scheduler(num_pages=6, page_size=4)
    big = make_request(prompt_len=4, max_new=16)  # 5 pages
    sched.add(make_request(prompt_len=4, max_new=4))  # 2 pages, admitted
    sched.add(big)
    small = make_request(prompt_len=1, max_new=1)  # would fit, but waits behind big
    sched.add(small)
    out, _ = step(sched)
    assert len(out.items) == 1
    run_to_completion(sched)
    assert big.finish_reason is small.finish_reason is FinishReason.LENGTH
    sched.check_no_leaks()


# ---- stop conditions ----------------------------------------------------------------------------


def test_stop_token_finishes_with_stop_and_keeps_token() -> None:
    sched, _ = make_scheduler()
    req = make_request(max_new=10, stop_token_ids=(5,))
    sched.add(req)
    tokens = iter([1, 2, 5, 9])
    run_to_completion(sched, lambda r: next(tokens))
    assert req.output_token_ids == [1, 2, 5] and req.finish_reason is FinishReason.STOP
    sched.check_no_leaks()


def test_eos_stops_unless_ignore_eos() -> None:
    sched, _ = make_scheduler(eos_token_ids=(2,))
    normal, ignoring = make_request(max_new=4), make_request(max_new=4, ignore_eos=True)
    sched.add(normal)
    sched.add(ignoring)
    run_to_completion(sched, lambda r: 2)
    assert normal.output_token_ids == [2] and normal.finish_reason is FinishReason.STOP
    assert ignoring.output_token_ids == [2] * 4 and ignoring.finish_reason is FinishReason.LENGTH
    sched.check_no_leaks()


def test_max_new_tokens_one_finishes_after_prefill() -> None:
    sched, _ = make_scheduler()
    req = make_request(prompt_len=5, max_new=1)
    sched.add(req)
    _, done = step(sched)
    assert done == [req] and req.finish_reason is FinishReason.LENGTH
    sched.check_no_leaks()


# ---- abort in every state -----------------------------------------------------------------------


def test_abort_waiting_request() -> None:
    sched, _ = make_scheduler(max_num_seqs=1)
    a, b = make_request(), make_request()
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.abort(b.request_id) is b and b.finish_reason is FinishReason.ABORT
    assert sched.num_waiting == 0
    sched.abort(a.request_id)
    sched.check_no_leaks()


def test_abort_mid_chunked_prefill_and_mid_decode() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=4)
    a, b = make_request(prompt_len=12, max_new=10), make_request(prompt_len=2, max_new=10)
    sched.add(a)
    step(sched)
    assert a.is_prefill and a.page_ids
    assert sched.abort(a.request_id) is a and a.page_ids == []
    sched.add(b)
    step(sched)
    step(sched)
    assert b.num_output_tokens == 2
    assert sched.abort(b.request_id) is b
    assert not sched.has_unfinished()
    sched.check_no_leaks()


def test_abort_between_schedule_and_update_skips_the_item() -> None:
    sched, _ = make_scheduler()
    a, b = make_request(max_new=3), make_request(max_new=3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort(a.request_id)
    done = sched.update(out, [(1, -1.0), (2, -2.0)])
    assert done == [] and a.output_token_ids == [] and b.output_token_ids == [2]
    run_to_completion(sched)
    sched.check_no_leaks()


def test_abort_unknown_or_finished_returns_none() -> None:
    sched, _ = make_scheduler()
    assert sched.abort("nope") is None
    req = make_request(max_new=1)
    sched.add(req)
    step(sched)
    assert sched.abort(req.request_id) is None
    assert req.finish_reason is FinishReason.LENGTH


# ---- adopting transferred KV (decode node) ------------------------------------------------------


def test_request_arriving_with_kv_and_first_token() -> None:
    sched, alloc = make_scheduler(page_size=4)
    req = make_request(prompt_len=9, max_new=3)
    req.page_ids = alloc.allocate(3)
    req.num_computed_tokens = 9
    req.output_token_ids.append(42)
    req.output_logprobs.append(-0.1)
    sched.add(req)
    out, _ = step(sched)
    assert [(i.start, i.num_tokens, i.needs_sample) for i in out.items] == [(9, 1, True)]
    run_to_completion(sched)
    assert req.output_token_ids == [42, 7, 7]
    sched.check_no_leaks()


# ---- invalid input -------------------------------------------------------------------------------


def test_invalid_requests() -> None:
    sched, _ = make_scheduler(num_pages=8, page_size=4, max_model_len=100, vocab_size=1000)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        sched.add(Request("e", [], SamplingParams()))
    with pytest.raises(InvalidRequestError, match=r"90.*20.*max_model_len 100"):
        sched.add(make_request(prompt_len=90, max_new=20))
    with pytest.raises(InvalidRequestError, match="KV pages"):
        sched.add(make_request(prompt_len=30, max_new=10))  # 10 pages > 8
    with pytest.raises(InvalidRequestError, match="temperature"):
        sched.add(make_request(temperature=-1.0))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        sched.add(make_request(stop_token_ids=(1000,)))
    with pytest.raises(InvalidRequestError, match="prompt token"):
        sched.add(Request("v", [1, 1000], SamplingParams()))
    ok = make_request()
    sched.add(ok)
    with pytest.raises(DuplicateRequestError, match="duplicate"):
        sched.add(Request(ok.request_id, [1], SamplingParams()))
    assert sched.num_waiting == 1
    sched.abort(ok.request_id)
    sched.check_no_leaks()


def test_update_with_wrong_sample_count_raises() -> None:
    sched, _ = make_scheduler()
    sched.add(make_request())
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(out, [])


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(num_pages=0, page_size=4, max_model_len=10)


# ---- properties ---------------------------------------------------------------------------------

_workload = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 24), st.integers(0, 4)), min_size=1, max_size=12
)


@settings(max_examples=120, deadline=None)
@given(
    work=_workload,
    page_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    extra_pages=st.integers(0, 6),
)
def test_random_workloads_finish_without_running_out_of_pages(
    work: list[tuple[int, int, int]], page_size: int, budget: int, max_seqs: int, extra_pages: int
) -> None:
    # The pool fits the largest request plus a little: too small to hold everything at once.
    worst = max(-(-(p + m) // page_size) for p, m, _ in work)
    sched, _ = make_scheduler(
        num_pages=worst + extra_pages, page_size=page_size, max_num_batched_tokens=budget,
        max_num_seqs=max_seqs, eos_token_ids=(3,),
    )
    reqs = [make_request(prompt_len=p, max_new=m) for p, m, _ in work]
    for r in reqs:
        sched.add(r)
    # token 3 (EOS) is sampled now and then, depending on the request and its length
    done = run_to_completion(sched, lambda r: 3 if (r.num_tokens * 7 + len(r.request_id)) % 11 == 0
                             else 5)
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    for r, (_, max_new, _) in zip(reqs, work, strict=True):
        assert 1 <= r.num_output_tokens <= max_new
        assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    sched.check_no_leaks()


_action = st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 1000))


@settings(max_examples=120, deadline=None)
@given(actions=st.lists(_action, max_size=60), budget=st.integers(1, 24))
def test_any_interleaving_of_add_step_abort_returns_all_pages(
    actions: list[tuple[str, int]], budget: int
) -> None:
    sched, alloc = make_scheduler(num_pages=12, page_size=4, max_num_batched_tokens=budget,
                                  max_num_seqs=3)
    known: list[Request] = []
    pending = None
    for kind, arg in actions:
        if kind == "add":
            req = make_request(prompt_len=1 + arg % 30, max_new=1 + arg % 13)
            sched.add(req)
            known.append(req)
        elif kind == "abort" and known:
            sched.abort(known[arg % len(known)].request_id)
        elif kind == "step":
            if pending is not None:  # apply the previous step late, after aborts in between
                out, sampled = pending
                sched.update(out, sampled)
            out = sched.schedule()
            assert out.num_tokens <= budget
            pending = (out, [(arg % 50, -1.0) for i in out.items if i.needs_sample])
        sched.check_invariants()
    if pending is not None:
        sched.update(*pending)
    for req in known:
        sched.abort(req.request_id)
    assert all(r.is_finished and r.page_ids == [] for r in known)
    assert alloc.num_free == 12
    sched.check_no_leaks()
