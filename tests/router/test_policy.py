"""The routing policies (router/policy.py) on fake workers: the cache-aware pick prefers the
longest cached prefix, falls back to the least loaded when nothing matches or the loads are
imbalanced, keeps least-loaded's ranking of unhealthy and cooling workers, forgets a worker's
cache when a request failed on it or it restarted; its approximate trees stay within their bound
(router/prefix_tree.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from proto.pdserve.v1 import worker_pb2 as wpb
from router.config import CACHE_AWARE, RoutingConfig
from router.errors import WorkerFailure
from router.policy import CacheAware, LeastLoaded, Policy, make_policy, pick_answering
from router.prefix_tree import ApproxTree
from router.workers import DECODE, PREFILL, Worker

PAGE = 4
A = list(range(100, 112))  # three full blocks
B = list(range(200, 212))


def worker(address: str, kind: str = DECODE, running: int = 0) -> Worker:
    report = wpb.LoadReport(instance_id="one", page_size=PAGE, running_requests=running)
    return Worker(address, kind, cast(Any, None), cast(Any, None), report=report, healthy=True)


def pick(policy: Policy, workers: list[Worker], token_ids: list[int]) -> Worker:
    """What the router does with a worker that answers: choose it, then route to it."""
    worker = policy.choose(workers, token_ids)
    policy.routed(worker, token_ids)
    return worker


def cache_aware(**kw: Any) -> CacheAware:
    policy = make_policy(RoutingConfig(CACHE_AWARE, **kw))
    assert isinstance(policy, CacheAware)
    return policy


def test_longest_match_wins_and_no_match_goes_to_the_least_loaded() -> None:
    policy = cache_aware()
    w0, w1 = worker("d:0"), worker("d:1")
    assert pick(policy, [w0, w1], A + [1]) is w0  # nothing cached anywhere: least loaded (tie)
    w0.acquire(12)
    assert pick(policy, [w0, w1], A + [2]) is w0  # busier, but it holds A's three blocks
    assert pick(policy, [w0, w1], B) is w1  # nothing matches: least loaded
    w1.acquire(12)
    w1.acquire(12)
    assert pick(policy, [w0, w1], B[:8] + A) is w1  # 2 blocks of B beat 0 blocks of A
    assert pick(policy, [w0, w1], A[:4] + B) is w0  # 1 block of A beats nothing on w1
    assert policy.matched(w0, A) == 12 and policy.matched(w1, A) == 0
    assert policy.matched(w1, B + [9]) == 12  # prompts are matched by full blocks


def test_imbalanced_loads_go_to_the_least_loaded() -> None:
    policy = cache_aware(balance_abs_threshold=4, balance_rel_threshold=2.0)
    w0, w1 = worker("d:0"), worker("d:1")
    assert pick(policy, [w0, w1], A) is w0
    w0.report = wpb.LoadReport(instance_id="one", page_size=PAGE, running_requests=5)
    w1.report = wpb.LoadReport(instance_id="one", page_size=PAGE, running_requests=2)
    assert not policy.imbalanced([w0, w1])  # 3 apart: within the absolute threshold
    assert pick(policy, [w0, w1], A) is w0
    w1.report = wpb.LoadReport(instance_id="one", page_size=PAGE, running_requests=0)
    assert policy.imbalanced([w0, w1])  # 5 apart and 5 > 2 * 0
    assert pick(policy, [w0, w1], A) is w1
    assert policy.matched(w1, A) == 12  # the prompt is now believed cached there too
    w1.report = wpb.LoadReport(instance_id="one", page_size=PAGE, running_requests=1)
    assert not cache_aware(balance_abs_threshold=2,
                           balance_rel_threshold=6.0).imbalanced([w0, w1])  # 5 <= 6 * 1


def test_ranking_of_unhealthy_and_cooling_workers_is_kept() -> None:
    policy = cache_aware()
    w0, w1, w2 = worker("d:0"), worker("d:1"), worker("d:2")
    assert pick(policy, [w0], A) is w0
    w0.healthy = False
    assert pick(policy, [w0, w1], A) is w1  # the match is on an unreachable worker
    w0.healthy = True
    w0.cooldown_until = float("inf")  # cooling down (without a failure: the tree stays)
    assert policy.matched(w0, A) == 12
    assert pick(policy, [w0, w2], A) is w2
    w1.healthy = w2.healthy = False
    assert pick(policy, [w0, w1, w2], B) is w0  # the best rank left
    with pytest.raises(WorkerFailure):
        pick(policy, [], A)


def test_a_failure_or_a_restart_clears_the_workers_tree() -> None:
    policy = cache_aware()
    w0, w1 = worker("d:0"), worker("d:1")
    pick(policy, [w0], A)
    pick(policy, [w1], A)
    w0.note_failure("transfer failed")
    assert policy.matched(w0, A) == 0 and policy.matched(w1, A) == 12
    pick(policy, [w0], A)
    assert policy.matched(w0, A) == 12
    w1.take_report(wpb.LoadReport(instance_id="one", page_size=PAGE))  # the same instance
    assert policy.matched(w1, A) == 12
    w1.take_report(wpb.LoadReport(instance_id="two", page_size=PAGE))  # it restarted
    assert policy.matched(w1, A) == 0
    pick(policy, [w1], A)
    w1.take_report(wpb.LoadReport(instance_id="two", page_size=2 * PAGE))  # other pages
    assert policy.matched(w1, A) == 0


def test_prefill_and_decode_trees_are_apart() -> None:
    policy = cache_aware()
    p, d = worker("h:1", PREFILL), worker("h:1", DECODE)
    pick(policy, [p], A)
    assert policy.matched(p, A) == 12 and policy.matched(d, A) == 0


def test_approx_tree_keeps_its_bound_dropping_least_recent_leaves() -> None:
    tree = ApproxTree(PAGE, max_blocks=4)
    seven = A[:4] + [7] * 4
    tree.insert(A)  # 3 blocks
    tree.insert(B[:4])  # 4 blocks
    assert len(tree) == 4
    tree.insert(seven)  # a 5th block: A's tail, the least recently used leaf, goes
    assert len(tree) == 4
    assert (tree.match(A), tree.match(B), tree.match(seven)) == (8, 4, 8)
    tree.insert(B[:8])  # a 6th: A's second block goes (A's head was touched with seven)
    assert len(tree) == 4
    assert (tree.match(A), tree.match(B), tree.match(seven)) == (4, 8, 8)


def test_least_loaded_ignores_the_prompt() -> None:
    w0, w1 = worker("d:0"), worker("d:1")
    w0.acquire(4)
    assert pick(LeastLoaded(), [w0, w1], A) is w1
    assert isinstance(make_policy(RoutingConfig()), LeastLoaded)
    with pytest.raises(ValueError, match="--kv-events needs"):
        RoutingConfig(kv_events=True)
    for rel in (0.5, float("nan")):  # nan compared false both ways, and passed
        with pytest.raises(ValueError, match="--balance-rel-threshold >= 1"):
            RoutingConfig(balance_rel_threshold=rel)


class _Pool:
    """What :func:`pick_answering` uses of a ``WorkerPool``: ``ensure`` asks a worker, here
    finding the ``dead`` ones unreachable (as a killed or restarting node's ``GetLoad`` is)."""

    def __init__(self, *dead: Worker) -> None:
        self.dead, self.asked = set(map(id, dead)), []

    async def ensure(self, w: Worker) -> None:
        self.asked.append(w.address)
        if id(w) in self.dead:
            w.healthy, w.error = False, "GetLoad failed: DEADLINE_EXCEEDED"


def test_a_pick_that_does_not_answer_goes_to_the_next_worker() -> None:
    """The soak caught it: a decode killed and not yet seen dead by the poll was picked, did not
    answer, and its request failed while the other decode was idle."""
    w0, w1, w2 = worker("d:0"), worker("d:1", running=1), worker("d:2", running=2)
    pool = _Pool(w0, w1)
    got = asyncio.run(pick_answering(LeastLoaded(), cast(Any, pool), [w0, w1, w2], A,
                                     lambda w: w.healthy))
    assert got is w2 and pool.asked == ["d:0", "d:1", "d:2"]
    everyone = _Pool(w2)  # none answers: the last one asked comes back, its error names it
    w0.healthy = w1.healthy = False
    got = asyncio.run(pick_answering(LeastLoaded(), cast(Any, everyone), [w2], A,
                                     lambda w: w.healthy))
    assert got is w2 and not got.healthy and "GetLoad failed" in got.error
    with pytest.raises(WorkerFailure):
        asyncio.run(pick_answering(LeastLoaded(), cast(Any, everyone), [], A,
                                   lambda w: w.healthy))


def test_a_pick_that_does_not_answer_gets_nothing_in_its_tree() -> None:
    """The approximate tree of a worker set aside (it did not answer, but did not restart: its
    cache epoch stays) must not claim the prompt it was never sent; the worker that is sent it
    gets it."""
    policy = cache_aware()
    w0, w1 = worker("d:0"), worker("d:1", running=1)
    got = asyncio.run(pick_answering(policy, cast(Any, _Pool(w0)), [w0, w1], A,
                                     lambda w: w.healthy))
    assert got is w1
    w0.healthy, w0.error = True, ""  # it answers again, same instance: same cache epoch
    assert policy.matched(w0, A) == 0 and policy.matched(w1, A) == len(A)
    none = asyncio.run(pick_answering(policy, cast(Any, _Pool(w0)), [w0], B,
                                      lambda w: w.healthy))
    assert none is w0 and not none.healthy and policy.matched(w0, B) == 0
