"""The staging buffer a source rank gathers head slices into before a head-sliced send.

The transfer layer moves bytes by address and never touches tensors; the owner of the KV pool
provides the staging buffer and the gather (``engine.kv_staging.HeadStagingBuffer`` does it with
torch, on the pool's device). The manager registers the buffer once, with its KV entries.

Layout of one gather of ``m`` pages at byte ``offset`` of the buffer: entry-major, then page,
each slice page ``page_size * count * head_bytes`` bytes, token-major inside like a pool page:
``[entries, m, page_size, count, head_dim]``. Entry ``e``'s page ``k`` starts at byte
``offset + (e * m + k) * slice_page_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


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
