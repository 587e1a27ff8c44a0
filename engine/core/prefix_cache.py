"""The prefix cache: KV pages of full token blocks, shared by reference count, evicted LRU.

Blocks and keys. Block ``k`` of a request holds tokens ``[k * P, (k + 1) * P)`` (``P`` = page
size), i.e. exactly the request's page ``k``. Its *chain hash* is::

    chain(k) = blake2b(chain(k - 1) || int64 token ids of block k || visual digests of block k)

with ``chain(-1)`` empty. A visual input's digest (a hash of its patches, grid and timing: see
:mod:`engine.multimodal.visual_digest`) belongs to the block holding the *first* of its placeholder
tokens; every later block chains it. So two blocks are equal only if everything before them and in
them is equal: tokens, images, videos. That also makes the mrope positions of the cached KV the
ones the new request would compute, because a prompt's positions up to index ``i`` depend only
on its tokens and visual grids up to ``i``.

The dictionary key of a cached block is ``(chain(k), next)``. ``next`` is -1, except in *draft
mode* (EAGLE, :meth:`PrefixCache.set_draft_mode`): the draft model's KV lives in the same page ids
(``engine/runner/draft_runner.py``), and its row ``p`` pairs the target feature of ``p`` with token
``p + 1``. The draft KV of a block's last row therefore depends on the token after the block,
which ``next`` adds to the key: a hit then skips the draft's compute exactly as it skips the
target's, and the reused draft KV is the KV the draft would have written.

Reference counts (``engine/core/page_allocator.py``). The cache holds exactly one allocator
reference on each cached page; each request holds one on each page in its ``page_ids``. A cached
page is *evictable* iff the cache's reference is its only one (refcount 1); evictable pages sit in
an LRU order, least recently released first (a request's tail blocks before its head blocks, so an
eviction seldom cuts a chain in the middle). Evicting drops the cache's reference, which frees
the page. So pages fall into three sets, disjoint: free, held by requests (possibly cached too),
and cached-only (evictable); the scheduler counts ``free + evictable`` as available.

Invariants (checked by :meth:`PrefixCache.check`): ``_blocks`` and ``_page_key`` are inverse
maps; every cached page has a refcount >= 1; a cached page is in ``_lru`` iff its refcount is 1.

Hybrid models (:attr:`PrefixCache.checkpoints` set, ``engine/core/state_checkpoints.py``): a
request's linear-attention state exists only where a checkpoint kept it, so :meth:`match` cuts a
KV hit back to the longest prefix whose boundary has a state checkpoint (never a hit without its
state), and :meth:`restore_slot` names the checkpoint the request's slot starts from. A decode
node adopting a transfer takes KV only (``kv_only``): the prefill sends the final state.

Listener (optional, :attr:`PrefixCache.listener`): told of every block stored and removed and of
:meth:`PrefixCache.clear`, on the thread that changes the cache (a node's engine thread, under its
loop lock), so it must be cheap. A block's *id* there is its key as bytes: the chain hash, with
the ``next`` token appended in draft mode; the parent's id is the key the block's chain extends.

Pure Python: no torch here (the scheduler core uses it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.page_allocator import PageAllocator
from engine.core.request import Request
from engine.core.state_checkpoints import StateCheckpoints

BlockKey = tuple[bytes, int]  # (chain hash, next token or -1)
NO_NEXT = -1


class CacheListener(Protocol):
    """What a :class:`PrefixCache` tells of its changes (see the module docstring)."""

    def block_stored(self, block_id: bytes, parent_id: bytes, token_ids: list[int]) -> None:
        """A block entered the cache; ``parent_id`` is empty for a sequence's first block."""

    def blocks_removed(self, block_ids: list[bytes]) -> None:
        """Blocks were evicted."""

    def cleared(self) -> None:
        """Every block was dropped."""


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made (``hit_tokens`` over ``queried_tokens`` is the hit
    rate of the prompts looked up at admission)."""

    queries: int = 0  # requests looked up at admission
    queried_tokens: int = 0  # their prompt tokens
    hit_tokens: int = 0  # prompt tokens whose KV came from the cache (not computed)
    inserted_blocks: int = 0
    evicted_blocks: int = 0


@dataclass(eq=False)
class PrefixCursor:
    """A request's progress through the cache (``Request.prefix_state``).

    ``chains[k]`` is the chain hash of block ``k`` (computed lazily, once); blocks
    ``[0, handled)`` are in the cache already or were found there (inserting them again is a
    no-op)."""

    chains: list[bytes] = field(default_factory=list)
    handled: int = 0


class PrefixCache:
    """Full KV pages keyed by chained block hashes (see the module docstring)."""

    def __init__(self, page_size: int, allocator: PageAllocator,
                 checkpoints: StateCheckpoints | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if checkpoints is not None and checkpoints.interval % page_size:
            raise ValueError(f"state checkpoints every {checkpoints.interval} tokens do not sit "
                             f"on {page_size}-token page boundaries")
        self.page_size = page_size
        self.allocator = allocator
        self.checkpoints = checkpoints
        self.draft_mode = False
        self.stats = PrefixCacheStats()
        self.listener: CacheListener | None = None
        self._blocks: dict[BlockKey, int] = {}  # key -> page
        self._page_key: dict[int, BlockKey] = {}  # page -> key
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        """Pages the cache holds a reference on (evictable or also held by requests)."""
        return len(self._blocks)

    @property
    def num_evictable(self) -> int:
        """Cached pages no request holds: freed on demand."""
        return len(self._lru)

    def set_draft_mode(self, on: bool) -> None:
        """Key blocks by the token after them too (EAGLE: see the module docstring). Drops every
        cached block, since blocks cached before lack the draft's KV."""
        if on != self.draft_mode:
            self.clear()
            self.draft_mode = on

    # ---- admission -----------------------------------------------------------------------------

    def match(self, req: Request, *, kv_only: bool = False) -> list[int]:
        """Pages of the longest cached prefix of ``req``'s prompt, block by block, leaving at
        least the prompt's last token to compute (its logits give the first output token).
        With state checkpoints, only up to the last boundary holding one, unless ``kv_only``
        (a decode whose state arrives with the transfer). Takes no reference: :meth:`take`
        does, once the scheduler admits the request."""
        prompt = req.prompt_token_ids
        pages: list[int] = []
        size = self.page_size
        k = 0
        while (k + 1) * size < len(prompt):
            page = self._blocks.get(self.boundary_key(req, k + 1))
            if page is None:
                break
            pages.append(page)
            k += 1
        ck = self.checkpoints
        if ck is None or kv_only:
            return pages
        while k and not (ck.is_boundary(k * size) and self.boundary_key(req, k) in ck):
            k -= 1
        return pages[:k]

    def boundary_key(self, req: Request, blocks: int) -> BlockKey:
        """The key of block ``blocks - 1`` of ``req`` (``blocks >= 1``, whose boundary lies
        inside the prompt in draft mode): a page's key, and the key of the state checkpoint
        after the first ``blocks`` blocks."""
        end = blocks * self.page_size
        nxt = _token_at(req, end) if self.draft_mode else NO_NEXT
        return self._chain(req, _cursor(req), blocks - 1), nxt

    def restore_slot(self, req: Request, blocks: int) -> int:
        """The checkpoint slot holding ``req``'s state after its first ``blocks`` blocks (a
        :meth:`match` result's length, with checkpoints); counts a restore."""
        assert self.checkpoints is not None
        slot = self.checkpoints.get(self.boundary_key(req, blocks))
        assert slot is not None, "a hybrid prefix hit without its state checkpoint"
        self.checkpoints.stats.restored += 1
        return slot

    def num_pinned_by(self, pages: list[int]) -> int:
        """How many of ``pages`` (a :meth:`match` result) are evictable now, i.e. would stop
        being available when a request takes them."""
        return sum(1 for p in pages if p in self._lru)

    def pin(self, pages: list[int]) -> None:
        """Take one reference on each of the matched ``pages`` (no longer evictable)."""
        self.allocator.share(pages)
        for page in pages:
            self._lru.pop(page, None)

    def take(self, req: Request, pages: list[int], *, pinned: bool = False) -> None:
        """Give ``req`` (holding no pages yet) the matched ``pages``: one reference each (taken
        here, or by :meth:`pin` already when ``pinned``); its first ``len(pages) * page_size``
        tokens count as computed."""
        assert not req.page_ids and req.num_computed_tokens == 0, "take() on a started request"
        self.stats.queries += 1
        self.stats.queried_tokens += req.num_prompt_tokens
        if not pages:
            return
        if not pinned:
            self.pin(pages)
        req.page_ids = list(pages)
        req.num_computed_tokens = req.num_cached_tokens = len(pages) * self.page_size
        _cursor(req).handled = len(pages)
        self.stats.hit_tokens += req.num_computed_tokens

    # ---- insertion and release -----------------------------------------------------------------

    def insert(self, req: Request) -> None:
        """Cache ``req``'s full blocks whose KV is complete (``num_computed_tokens`` covers them;
        in draft mode the token after the block must be known too). A block whose key is cached
        already keeps the cached page. O(1) when no block completed since the last call."""
        cursor = _cursor(req)
        size = self.page_size
        end = req.num_computed_tokens
        if self.draft_mode:
            end = min(end, req.num_tokens - 1)
        k = cursor.handled
        while (k + 1) * size <= end and k < len(req.page_ids):
            key = self.boundary_key(req, k + 1)
            if key not in self._blocks:
                page = req.page_ids[k]
                self.allocator.share([page])
                self._blocks[key] = page
                self._page_key[page] = key
                self.stats.inserted_blocks += 1
                if self.listener is not None:
                    self._tell_stored(req, cursor, k, key)
            k += 1
        cursor.handled = k

    def release(self, pages: list[int]) -> None:
        """After a request freed ``pages`` (its whole page list, in order): the cached ones
        that only the cache holds now become evictable, the tail's first."""
        refcount = self.allocator.refcount
        for page in reversed(pages):
            if page in self._page_key and refcount(page) == 1:
                self._lru[page] = None
                self._lru.move_to_end(page)

    # ---- eviction ------------------------------------------------------------------------------

    def evict(self, n: int) -> int:
        """Free up to ``n`` evictable pages, least recently released first; returns how many."""
        freed: list[int] = []
        keys: list[BlockKey] = []
        while len(freed) < n and self._lru:
            page, _ = self._lru.popitem(last=False)
            keys.append(self._page_key.pop(page))
            del self._blocks[keys[-1]]
            freed.append(page)
        self.allocator.free(freed)
        self.stats.evicted_blocks += len(freed)
        if self.listener is not None and keys:
            self.listener.blocks_removed([block_id(key) for key in keys])
        return len(freed)

    def clear(self) -> None:
        """Forget every block and drop the cache's references (pages that requests still hold
        stay theirs). After this, with no request left, the allocator is entirely free."""
        self.stats.evicted_blocks += len(self._lru)
        pages = list(self._page_key)
        self._blocks.clear()
        self._page_key.clear()
        self._lru.clear()
        self.allocator.free(pages)
        if self.checkpoints is not None:
            self.checkpoints.clear()
        if self.listener is not None:
            self.listener.cleared()

    # ---- checks --------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants of the module docstring (O(cached pages); for tests)."""
        assert len(self._blocks) == len(self._page_key)
        for key, page in self._blocks.items():
            assert self._page_key[page] == key, (page, key)
            rc = self.allocator.refcount(page)
            assert rc >= 1, f"cached page {page} is free"
            assert (rc == 1) == (page in self._lru), (page, rc)
        assert all(p in self._page_key for p in self._lru)
        if self.checkpoints is not None:
            self.checkpoints.check()

    # ---- helpers -------------------------------------------------------------------------------

    def _tell_stored(self, req: Request, cursor: PrefixCursor, k: int, key: BlockKey) -> None:
        """Tell the listener block ``k`` of ``req`` (key ``key``) was stored."""
        assert self.listener is not None
        size = self.page_size
        tokens = _tokens(req, k * size, (k + 1) * size)
        parent = b""
        if k > 0:  # in draft mode the parent's key ends with this block's first token
            parent = block_id((cursor.chains[k - 1], tokens[0] if self.draft_mode else NO_NEXT))
        self.listener.block_stored(block_id(key), parent, tokens)

    def _chain(self, req: Request, cursor: PrefixCursor, k: int) -> bytes:
        chains = cursor.chains
        size = self.page_size
        while len(chains) <= k:
            i = len(chains)
            h = hashlib.blake2b(chains[-1] if chains else b"", digest_size=16)
            h.update(array("q", _tokens(req, i * size, (i + 1) * size)).tobytes())
            for start, digest in req.visual_keys:
                if i * size <= start < (i + 1) * size:
                    h.update(digest)
            chains.append(h.digest())
        return chains[k]


def block_id(key: BlockKey) -> bytes:
    """A block key as the listener's bytes: the chain hash, plus the next token in draft mode."""
    chain, nxt = key
    return chain if nxt == NO_NEXT else chain + nxt.to_bytes(8, "little", signed=True)


def _cursor(req: Request) -> PrefixCursor:
    if req.prefix_state is None:
        req.prefix_state = PrefixCursor()
    assert isinstance(req.prefix_state, PrefixCursor)
    return req.prefix_state


def _tokens(req: Request, a: int, b: int) -> list[int]:
    """Tokens ``[a, b)`` of prompt + output, without copying the whole sequence."""
    prompt = req.prompt_token_ids
    n = len(prompt)
    if b <= n:
        return prompt[a:b]
    if a >= n:
        return req.output_token_ids[a - n : b - n]
    return prompt[a:] + req.output_token_ids[: b - n]


def _token_at(req: Request, i: int) -> int:
    n = len(req.prompt_token_ids)
    return req.prompt_token_ids[i] if i < n else req.output_token_ids[i - n]
