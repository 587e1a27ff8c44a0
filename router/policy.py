"""Routing policies: which of a set of workers gets a request (the prefill pick and the decode
pick alike; ``--policy``).

- :class:`LeastLoaded` (default): the lowest :meth:`router.workers.Worker.score`.
- :class:`CacheAware`: among the workers of the best :attr:`~router.workers.Worker.rank`
  (healthy before cooling before unreachable, exactly as least-loaded ranks them), the one whose
  prefix cache holds the longest prefix of the prompt, ties and no match going to the least
  loaded. When the loads (requests, :attr:`~router.workers.Worker.load`) are imbalanced, i.e.
  ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min`` (SGLang's
  rule), the least loaded wins whatever the caches hold.

What :class:`CacheAware` knows of a worker's cache is a :mod:`router.prefix_tree` per worker, in
blocks of the worker's page size (``LoadReport.page_size``):

- approximate (default): each prompt is inserted into the tree of the worker it was sent to. A
  worker whose :attr:`~router.workers.Worker.cache_epoch` moved (a request failed on it, or it
  restarted) starts over with an empty tree.
- precise (``--kv-events``): the trees are built from the workers' cache events
  (:mod:`router.kv_events`) and nothing is inserted on a pick. A worker whose stream is down
  has an empty tree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.config import CACHE_AWARE, RoutingConfig
from router.kv_events import KvEventFeeds
from router.prefix_tree import ApproxTree, PrefixTree
from router.workers import Worker, WorkerPool


class Policy(ABC):
    """Picks a worker for a request; :meth:`start` and :meth:`close` bracket its use."""

    @abstractmethod
    def choose(self, workers: Sequence[Worker], token_ids: Sequence[int]) -> Worker:
        """The worker of ``workers`` (all of one kind) that should get a request of prompt
        ``token_ids``, changing nothing. Raises :class:`router.errors.WorkerFailure` when
        ``workers`` is empty."""

    def routed(self, worker: Worker, token_ids: Sequence[int]) -> None:  # noqa: B027
        """Note that ``worker`` gets the request of prompt ``token_ids`` (nothing by default)."""

    async def start(self, pool: WorkerPool) -> None:  # noqa: B027 - nothing to start by default
        """Start what the policy runs in the background over ``pool``'s workers."""

    async def close(self) -> None:  # noqa: B027 - nothing to stop by default
        """Stop what :meth:`start` started."""


class LeastLoaded(Policy):
    """The least loaded worker (:meth:`WorkerPool.pick`)."""

    def choose(self, workers: Sequence[Worker], token_ids: Sequence[int]) -> Worker:
        return WorkerPool.pick(workers)


@dataclass
class _Approx:
    tree: ApproxTree
    epoch: int  # the worker's cache_epoch the tree was made for


class CacheAware(Policy):
    """The longest cached prefix unless the loads are imbalanced (see the module docstring)."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self.feeds = KvEventFeeds() if config.kv_events else None
        self._approx: dict[tuple[str, str], _Approx] = {}  # (kind, address) -> its tree
        self._pool: WorkerPool | None = None

    async def start(self, pool: WorkerPool) -> None:
        self._pool = pool
        if self.feeds is not None:
            await self.feeds.start(pool)

    async def close(self) -> None:
        if self.feeds is not None:
            await self.feeds.close()

    def choose(self, workers: Sequence[Worker], token_ids: Sequence[int]) -> Worker:
        if not workers:
            return WorkerPool.pick(workers)  # raises
        rank = min(w.rank for w in workers)
        best = [w for w in workers if w.rank == rank]
        chosen = WorkerPool.pick(best)
        if not self.imbalanced(best):
            matched = {id(w): self.matched(w, token_ids) for w in best}
            longest = max(matched.values())
            if longest:
                chosen = WorkerPool.pick([w for w in best if matched[id(w)] == longest])
        return chosen

    def routed(self, worker: Worker, token_ids: Sequence[int]) -> None:
        """Approximate trees: insert the prompt into ``worker``'s (precise ones follow the
        worker's own events)."""
        if self.feeds is None:
            tree = self.tree(worker)
            if tree is not None:
                tree.insert(token_ids)

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        """Whether the loads of ``workers`` differ beyond both thresholds."""
        loads = [w.load for w in workers]
        most, least = max(loads), min(loads)
        return (most - least > self.config.balance_abs_threshold
                and most > self.config.balance_rel_threshold * least)

    def matched(self, w: Worker, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids``'s longest prefix that ``w`` has cached, as far as known."""
        tree: PrefixTree | None = self.feeds.tree(w) if self.feeds else self.tree(w)
        return tree.match(token_ids) if tree is not None else 0

    def tree(self, w: Worker) -> ApproxTree | None:
        """``w``'s approximate tree, made anew when its cache epoch or page size changed; None
        while its page size is unknown (no ``GetLoad`` answered yet)."""
        size = w.report.page_size
        if not size:
            return None
        key = (w.kind, w.address)
        entry = self._approx.get(key)
        if entry is None or entry.epoch != w.cache_epoch or entry.tree.block_tokens != size:
            if entry is None and self._pool is not None:  # forget workers DNS dropped
                known = {(v.kind, v.address) for v in [*self._pool.all, *self._pool.retiring]}
                self._approx = {k: e for k, e in self._approx.items() if k in known}
            entry = self._approx[key] = _Approx(ApproxTree(size, self.config.max_tree_blocks),
                                                w.cache_epoch)
        return entry.tree


def make_policy(config: RoutingConfig) -> Policy:
    """The policy ``config`` names."""
    return CacheAware(config) if config.policy == CACHE_AWARE else LeastLoaded()


async def pick_answering(policy: Policy, pool: WorkerPool, workers: Sequence[Worker],
                         token_ids: Sequence[int],
                         usable: Callable[[Worker], bool]) -> Worker:
    """``policy``'s pick among ``workers`` (none: the policy's error), asked now when in doubt
    (:meth:`WorkerPool.ensure`); a pick that is not ``usable`` after that (it did not answer:
    killed, restarting) is set aside and the policy picks again among the rest. Returns the
    first usable pick, or the last one tried when none is (the caller fails the request with
    its error), so one dead worker does not cost a request while another one answers. Only a
    usable pick is :meth:`Policy.routed` (a cache-aware policy's approximate tree gets the
    prompt of a worker that is sent it, not of one set aside)."""
    left = list(workers)
    while True:
        worker = policy.choose(left, token_ids)
        await pool.ensure(worker)
        left.remove(worker)
        if usable(worker):
            policy.routed(worker, token_ids)
            return worker
        if not left:
            return worker
