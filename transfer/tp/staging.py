"""The staging buffer a source rank gathers head slices into before a head-sliced send, and the
landing buffer a destination rank takes whole slice pages into (:mod:`transfer.plan.heads`).

The transfer layer moves bytes by address and never touches tensors; the owner of the KV pool
provides the staging buffer and the gather (``engine.kv.staging.HeadStagingBuffer`` does it with
torch, on the pool's device). The manager registers the buffer once, with its KV entries.

Layout of one gather of ``m`` pages at byte ``offset`` of the buffer: entry-major, then page,
each slice page ``page_size * count * head_bytes`` bytes, token-major inside like a pool page:
``[entries, m, page_size, count, head_dim]``. Entry ``e``'s page ``k`` starts at byte
``offset + (e * m + k) * slice_page_bytes``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.kv.pool import BufferInfo


class HeadStaging(Protocol):
    """A registered buffer and the gather of head slices of the local pool's pages into it."""

    @property
    def ptr(self) -> int:
        """Base address of the buffer."""

    @property
    def nbytes(self) -> int:
        """Length of the buffer in bytes."""

    @property
    def device(self) -> str:
        """Where the buffer lives, as torch names it (``"cpu"``, ``"cuda:N"``, ``"npu:N"``)."""

    def gather(self, pages: Sequence[int], head_start: int, head_count: int,
               offset: int = 0) -> None:
        """Copy heads ``[head_start, head_start + head_count)`` of ``pages`` of every KV entry
        into the buffer from byte ``offset`` (layout in the module docstring); the bytes are in
        place when it returns."""


class HeadLanding(Protocol):
    """Per incoming slice (``slot``), pool-shaped landing entries of ``num_pages`` pages, and
    the scatter of landed pages into the slice's heads of the pool."""

    @property
    def num_pages(self) -> int:
        """Landing pages per slot."""

    def buffer_infos(self, slot: int | None = None) -> list[BufferInfo]:
        """The landing entries of ``slot`` (every slot when None), in KV entry order."""

    def scatter(self, landing_pages: Sequence[int], pages: Sequence[int],
                slot: int | None = None, layer_ids: Collection[int] | None = None) -> None:
        """Landing pages of ``slot`` (every slot when None) into their heads of pool ``pages``,
        in the entries of ``layer_ids`` (every entry when None: a pipeline stage lands its own
        layers only)."""


class LandingPages:
    """The free pages of one landing buffer, shared by the bootstrap clients that land into it
    (a prefill's client and the one that replaces it after a restart); thread-safe."""

    def __init__(self, num_pages: int) -> None:
        self._free = list(range(num_pages))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int] | None:
        """``n`` free pages, or None (none taken) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            out, self._free = self._free[:n], self._free[n:]
            return out

    def give(self, pages: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(pages)

    @property
    def free(self) -> list[int]:
        with self._lock:
            return sorted(self._free)
