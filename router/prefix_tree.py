"""The router's picture of one worker's prefix cache: a trie of full token blocks.

A worker caches KV by pages of ``block_tokens`` tokens (its page size), block ``k`` of a sequence
holding tokens ``[k * B, (k + 1) * B)`` and keyed by everything before it
(``engine/core/prefix_cache.py``). The trie has one node per cached block: a child of the node of
the block before it, under the block's token ids. :meth:`PrefixTree.match` walks a prompt's full
blocks from the root and says how many of its tokens the worker has cached.

Two ways to fill it:

- :class:`ApproxTree` (approximate): the router inserts each prompt it sends to the worker. It
  holds at most ``max_blocks`` nodes, dropping the least recently used leaves first.
- :class:`EventTree` (precise): the worker's ``SubscribeKvEvents`` stream stores and removes
  blocks by their cache ids; each node counts the cached blocks it stands for (images make
  blocks with equal tokens differ in the cache, and they share one node here), and a node whose
  count fell to 0 still carries its children until they go, but ends a match.

Neither sees images: a prompt whose images differ from a cached one's matches as far as its
tokens do (the worker's own cache then computes the rest).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

Block = tuple[int, ...]


class _Node:
    __slots__ = ("children", "held", "key", "parent")

    def __init__(self, parent: _Node | None, key: Block) -> None:
        self.parent = parent
        self.key = key
        self.children: dict[Block, _Node] = {}
        self.held = 0  # cached blocks this node stands for; 0 ends a match

    def detach(self) -> None:
        assert self.parent is not None
        del self.parent.children[self.key]


class PrefixTree:
    """The trie and its match (see the module docstring); ``block_tokens`` 0 matches nothing."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._root = _Node(None, ())

    def match(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids``'s longest cached prefix of full blocks."""
        node, size, k = self._root, self.block_tokens, 0
        while size and (k + 1) * size <= len(token_ids):
            child = node.children.get(tuple(token_ids[k * size:(k + 1) * size]))
            if child is None or not child.held:
                break
            node, k = child, k + 1
        return k * size

    def clear(self) -> None:
        """Forget every block."""
        self._root = _Node(None, ())


class ApproxTree(PrefixTree):
    """Filled with the prompts sent to the worker, bounded to ``max_blocks`` nodes (LRU)."""

    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        super().__init__(block_tokens)
        self.max_blocks = max_blocks
        # every node, least recently used first; a path is touched leaf first, so a node is
        # always more recent than its children and the oldest node is a leaf
        self._lru: OrderedDict[_Node, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, token_ids: Sequence[int]) -> None:
        """Add every full block of ``token_ids``; then drop the oldest leaves over the bound."""
        node, size = self._root, self.block_tokens
        path = []
        for k in range(len(token_ids) // size if size else 0):
            key = tuple(token_ids[k * size:(k + 1) * size])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key)
                child.held = 1
            path.append(child)
            node = child
        for n in reversed(path):
            self._lru[n] = None
            self._lru.move_to_end(n)
        while len(self._lru) > self.max_blocks:
            oldest, _ = self._lru.popitem(last=False)
            assert not oldest.children, "the least recently used node is a leaf"
            oldest.detach()

    def clear(self) -> None:
        super().clear()
        self._lru.clear()


class EventTree(PrefixTree):
    """Filled by a worker's cache events; ``block_tokens`` is 0 until the first block arrives
    after a :meth:`clear` (a new instance may have another page size)."""

    def __init__(self) -> None:
        super().__init__(0)
        self._by_id: dict[bytes, _Node] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def store(self, block_id: bytes, parent_id: bytes, token_ids: Sequence[int]) -> bool:
        """A block entered the cache; False (ignored) when its parent is unknown, its size is
        not the tree's or it is known already."""
        if not self._by_id and not self.block_tokens:
            self.block_tokens = len(token_ids)
        parent = self._root if not parent_id else self._by_id.get(parent_id)
        if parent is None or len(token_ids) != self.block_tokens or block_id in self._by_id:
            return False
        key = tuple(token_ids)
        node = parent.children.get(key)
        if node is None:
            node = parent.children[key] = _Node(parent, key)
        node.held += 1
        self._by_id[block_id] = node
        return True

    def remove(self, block_id: bytes) -> None:
        """A block left the cache (unknown ids are ignored)."""
        node = self._by_id.pop(block_id, None)
        if node is None:
            return
        node.held -= 1
        while node.parent is not None and not node.held and not node.children:
            node.detach()
            node = node.parent

    def clear(self) -> None:
        super().clear()
        self._by_id.clear()
        self.block_tokens = 0
