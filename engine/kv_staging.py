"""A staging buffer for head-sliced KV sends: head slices of pool pages, gathered contiguous.

The transfer layer (``transfer.staging.HeadStaging``) registers it with the KV entries and
calls :meth:`HeadStagingBuffer.gather` before writing each round; the layout is described there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HeadStagingBuffer:
    """``nbytes`` bytes on the entries' device, filled by :meth:`gather`.

    ``entries`` are the KV entries in transfer order, each ``[num_pages, page_size, heads,
    head_dim]`` of one dtype and device (a pool's :meth:`~engine.kv_cache.KVPool.entries`).
    """

    def __init__(self, entries: Sequence[torch.Tensor], nbytes: int) -> None:
        if not entries:
            raise ValueError("no KV entries to stage")
        first = entries[0]
        if any(e.dtype != first.dtype or e.device != first.device or e.shape[1:] != first.shape[1:]
               for e in entries):
            raise ValueError("KV entries differ in dtype, device or page shape")
        self.entries = list(entries)
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=first.device)

    @property
    def ptr(self) -> int:
        return int(self.buf.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.buf.numel())

    @property
    def device(self) -> str:
        return str(self.buf.device)

    def gather(self, pages: Sequence[int], head_start: int, head_count: int) -> None:
        """Heads ``[head_start, head_start + head_count)`` of ``pages`` of every entry, as
        ``[entries, len(pages), page_size, head_count, head_dim]`` from the buffer's start."""
        first = self.entries[0]
        _, page_size, _, head_dim = first.shape
        shape = (len(self.entries), len(pages), page_size, head_count, head_dim)
        need = first.element_size() * shape[0] * shape[1] * page_size * head_count * head_dim
        if need > self.nbytes:
            raise ValueError(f"gather of {need} bytes exceeds the {self.nbytes}-byte buffer")
        out = self.buf[:need].view(first.dtype).view(shape)
        idx = torch.tensor(list(pages), dtype=torch.long, device=first.device)
        for e, entry in enumerate(self.entries):
            torch.index_select(entry[:, :, head_start : head_start + head_count], 0, idx,
                               out=out[e])
        if first.device.type != "cpu":  # the engine reads the bytes next, off any stream
            getattr(torch, first.device.type).synchronize(first.device)
