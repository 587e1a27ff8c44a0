"""Buffers of head-sliced KV transfers between sides of different TP size.

:class:`HeadStagingBuffer` (source side): head slices of pool pages, gathered contiguous. The
transfer layer (``transfer.tp.staging.HeadStaging``) registers it with the KV entries and calls
:meth:`HeadStagingBuffer.gather` before writing each round; the layout is described there.

:class:`HeadLandingBuffer` (destination side): where source ranks that each hold part of this
rank's heads write whole pages, one pool-shaped entry set per incoming slice; once they arrived,
:meth:`HeadLandingBuffer.scatter` puts each slice into its heads of the pool's pages.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from engine.kv.pool import BufferInfo


class HeadStagingBuffer:
    """``nbytes`` bytes on the entries' device, filled by :meth:`gather`.

    ``entries`` are the KV entries in transfer order, each ``[num_pages, page_size, heads,
    head_dim]`` of one dtype and device (a pool's :meth:`~engine.kv.pool.KVPool.entries`).
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

    def gather(self, pages: Sequence[int], head_start: int, head_count: int,
               offset: int = 0) -> None:
        """Heads ``[head_start, head_start + head_count)`` of ``pages`` of every entry, as
        ``[entries, len(pages), page_size, head_count, head_dim]`` from byte ``offset``."""
        first = self.entries[0]
        _, page_size, _, head_dim = first.shape
        shape = (len(self.entries), len(pages), page_size, head_count, head_dim)
        need = first.element_size() * shape[0] * shape[1] * page_size * head_count * head_dim
        if offset < 0 or offset + need > self.nbytes or offset % first.element_size():
            raise ValueError(f"gather of {need} bytes at {offset} does not fit the "
                             f"{self.nbytes}-byte buffer")
        out = self.buf[offset : offset + need].view(first.dtype).view(shape)
        idx = torch.tensor(list(pages), dtype=torch.long, device=first.device)
        for e, entry in enumerate(self.entries):
            torch.index_select(entry[:, :, head_start : head_start + head_count], 0, idx,
                               out=out[e])
        if first.device.type != "cpu":  # the engine reads the bytes next, off any stream
            getattr(torch, first.device.type).synchronize(first.device)


class HeadLandingBuffer:
    """Per incoming slice ``(head_start, count)`` of this rank's heads, one buffer per KV entry
    of shape ``[num_pages, page_size, count, head_dim]`` (a pool of that slice's heads).

    ``entries`` and ``layer_ids``: the rank's KV entries in transfer order and their global
    layer ids; landing entries carry the same ids, so a source's layer pairing is unchanged.
    """

    def __init__(self, entries: Sequence[torch.Tensor], layer_ids: Sequence[int],
                 slices: Sequence[tuple[int, int]], num_pages: int) -> None:
        if len(entries) != len(layer_ids) or not entries:
            raise ValueError(f"{len(entries)} KV entries for {len(layer_ids)} layer ids")
        first = entries[0]
        _, page_size, heads, head_dim = first.shape
        if any(start < 0 or count < 1 or start + count > heads for start, count in slices):
            raise ValueError(f"slices {list(slices)} are outside the rank's {heads} heads")
        self.entries, self.layer_ids, self.slices = list(entries), list(layer_ids), list(slices)
        self.num_pages = num_pages
        # land[s][e]: [num_pages, page_size, count_s, head_dim]
        self.land = [[torch.zeros(num_pages, page_size, count, head_dim, dtype=first.dtype,
                                  device=first.device) for _ in entries]
                     for _, count in slices]

    def buffer_infos(self, slot: int | None = None) -> list[BufferInfo]:
        """The landing entries of slice ``slot`` (all slices when None), to register or send to."""
        slots = range(len(self.slices)) if slot is None else [slot]
        out = []
        for s in slots:
            for buf, lid in zip(self.land[s], self.layer_ids, strict=True):
                nbytes = buf.numel() * buf.element_size()
                out.append(BufferInfo(buf.data_ptr(), nbytes, nbytes // self.num_pages, lid,
                                      str(buf.device)))
        return out

    def scatter(self, landing_pages: Sequence[int], pages: Sequence[int],
                slot: int | None = None, layer_ids: Collection[int] | None = None) -> None:
        """Slice ``slot``'s (every slice's when None) landing pages ``landing_pages`` into its
        heads of pool ``pages``, in the entries of ``layer_ids`` (every entry when None): call
        it once the sources of those slices have written those layers (a slice or layer no
        source wrote would scatter stale bytes)."""
        if len(landing_pages) != len(pages):
            raise ValueError(f"{len(landing_pages)} landing pages for {len(pages)} pool pages")
        # copy_ per run of pages consecutive on both sides: torch's indexed copies into a
        # strided destination (index_copy_, index_put_) run about ten times slower on the CPU
        runs = _runs(landing_pages, pages)
        slots = range(len(self.slices)) if slot is None else [slot]
        for s in slots:
            (start, count), land = self.slices[s], self.land[s]
            for entry, buf, lid in zip(self.entries, land, self.layer_ids, strict=True):
                if layer_ids is not None and lid not in layer_ids:
                    continue
                heads = entry.narrow(2, start, count)
                for src, dst, n in runs:
                    heads[dst : dst + n].copy_(buf[src : src + n])


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` of the stretches where both page ids go up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
