"""Decode steps (one new token per sequence) as static forwards over persistent buffers.

The live batch of ``B`` sequences is copied into the first rows of the buffers and padded to the
next captured size ``bs``: padded rows are token 0 at position 0 whose K/V go to the engine's
scratch page (``pad_page``, never handed to a request) and attend to that one key; their outputs
are dropped. The forward reads only the buffers, so on CUDA it is captured once per size
(:class:`~engine.runner.cuda_graph.GraphCache`) and replayed with new lengths, pages and positions.
:meth:`DecodeGraphs.capture_all` captures every size up front (a batch of padded rows only), so
serving never captures.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.backend import AttentionBackend, AttentionBatch
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.runner.cuda_graph import GraphCache, StaticForward, capture_sizes_for


class DecodeGraphs:
    """Persistent decode buffers for up to ``max_bs`` sequences of up to ``max_pages`` pages."""

    def __init__(self, model: Qwen2VLModel, attn: AttentionBackend, *, max_bs: int,
                 max_pages: int, pad_page: int, enabled: bool,
                 sizes: Sequence[int] | None = None) -> None:
        pool = attn.pool
        device = pool.device
        self.model, self.attn = model, attn
        self.page_size = pool.page_size
        self.pad_page, self.max_pages = pad_page, max_pages
        self.graphs = GraphCache(device, sizes or capture_sizes_for(max_bs), enabled)
        n = self.graphs.max_size

        def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = ints(n)
        self.mrope = ints(3, n)
        self.slots = ints(n)
        self.kv_lens = ints(n, dtype=torch.int32)
        self.page_table = ints(n, max_pages, dtype=torch.int32)
        self.q_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.q_starts = torch.arange(n + 1, dtype=torch.int32, device=device)

    def fits(self, num_seqs: int, max_kv: int) -> bool:
        """Whether a decode batch of this size and longest sequence can run here."""
        return num_seqs <= self.graphs.max_size and max_kv <= self.max_pages * self.page_size

    def run(self, ids: torch.Tensor, mrope: torch.Tensor, kv_lens: torch.Tensor, max_kv: int,
            page_table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, H]`` of one decode token per sequence.

        ``ids``/``slots`` ``[B]``, ``mrope`` ``[3, B]``, ``kv_lens`` ``[B]`` (after this token),
        ``page_table`` ``[B, P]`` with ``P <= max_pages``, all on the pool's device; ``max_kv``
        is the host copy of ``max(kv_lens)``. The result is valid until the next call.
        """
        b = ids.shape[0]
        bs = self.graphs.padded(b)
        width = page_table.shape[1]
        self.input_ids[:b].copy_(ids)
        self.mrope[:, :b].copy_(mrope)
        self.slots[:b].copy_(slots)
        self.kv_lens[:b].copy_(kv_lens)
        self.page_table[:b, :width].copy_(page_table)
        self._pad(b, bs)
        # a captured graph keeps the capacity as its bound; an eager run uses the batch's own
        bound = self.max_pages * self.page_size if self.graphs.captures else max_kv
        return self.graphs.run("decode", bs, self._forward(bs, bound))[:b]

    def capture_all(self) -> list[str]:
        """Capture the forward of every size now (rows of padding only: nothing but the scratch
        page is written), so that serving only replays; the graphs captured, as ``name:size``
        (none unless :attr:`GraphCache.captures`)."""
        if not self.graphs.captures:
            return []
        for bs in self.graphs.sizes:
            self._pad(0, bs)
            self.graphs.run("decode", bs, self._forward(bs, self.max_pages * self.page_size))
        return [f"decode:{bs}" for bs in self.graphs.sizes]

    def _pad(self, b: int, bs: int) -> None:
        """Rows ``b..bs`` become padding: token 0 at position 0, one key on the scratch page."""
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.mrope[:, b:bs].zero_()
            self.slots[b:bs].fill_(self.pad_page * self.page_size)
            self.kv_lens[b:bs].fill_(1)
            self.page_table[b:bs, 0].fill_(self.pad_page)

    def _forward(self, bs: int, bound: int) -> StaticForward:
        """The static forward of ``bs`` rows, attention keys bounded by ``bound``."""

        def forward() -> torch.Tensor:
            batch = AttentionBatch(self.q_lens[:bs], self.kv_lens[:bs], self.q_starts[: bs + 1],
                                   self.page_table[:bs], self.slots[:bs], 1, bound)
            self.attn.prepare(batch)
            embeds = self.model.embed(self.input_ids[:bs])
            return self.model(embeds, self.mrope[:, :bs], self.attn)

        return forward
