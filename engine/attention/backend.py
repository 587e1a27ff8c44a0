"""Attention over the paged KV pool, behind a small backend interface.

A forward covers a batch of sequences, each contributing ``q_len`` new tokens (a prefill chunk,
one decode token, or a verify window) on top of ``kv_len - q_len`` tokens already in the pool.
New K/V are written at ``slot_mapping`` first; each query then attends causally to its
sequence's first ``kv_len - q_len + i + 1`` tokens, or, with a tree mask (speculative draft
trees), every key before the sequence's last ``W`` keys and those of the last ``W`` its row of
the mask admits. Backends: :class:`TorchPagedAttention` (gather + SDPA, CPU and anything torch
runs on); a CUDA or NPU kernel implements the same two methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kv.pool import KVPool


@dataclass(frozen=True)
class AttentionBatch:
    """Per-forward inputs of attention, built once and shared by every layer.

    Tensors live on the pool's device. ``page_table`` has at least ``ceil(max_kv / page_size)``
    columns; row ``b``'s first ``ceil(kv_lens[b] / page_size)`` entries are its pages in token
    order, the rest any in-range page (they are never read unmasked). ``max_q`` and ``max_kv``
    are host copies of the maxima, so no backend has to read the device to size its work.
    """

    q_lens: torch.Tensor  # [B] int32, new tokens per sequence
    kv_lens: torch.Tensor  # [B] int32, tokens in the pool per sequence after this forward's writes
    q_starts: torch.Tensor  # [B + 1] int32, row offset of each sequence's tokens (cumsum of q_lens)
    page_table: torch.Tensor  # [B, P] int32
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    max_q: int
    max_kv: int
    # [B, max_q, W] bool or None (causal): query q of sequence b sees key kv_len - W + w iff
    # tree_mask[b, q, w], and every key before kv_len - W
    tree_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.q_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def uniform(self) -> bool:
        """Whether every sequence has ``max_q`` new tokens (decode, verify, draft extend)."""
        return self.num_tokens == self.num_seqs * self.max_q

    @classmethod
    def build(
        cls,
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        page_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> AttentionBatch:
        """A batch from host-side lengths and a ``[B, P]`` page table on the target device.

        The lengths and row offsets are laid out in one host array (numpy: far cheaper than
        torch for a few dozen values) that reaches the device in one copy; on CPU the tensors
        share its memory.
        """
        b = len(q_lens)
        host = np.empty(3 * b + 1, dtype=np.int32)  # q_lens [B], kv_lens [B], q_starts [B + 1]
        host[:b] = q_lens
        host[b : 2 * b] = kv_lens
        host[2 * b] = 0
        np.cumsum(host[:b], out=host[2 * b + 1 :])
        lens = torch.from_numpy(host)
        device = page_table.device
        if device.type != "cpu":
            lens = lens.to(device, non_blocking=True)
        q, kv, starts = lens.split([b, b, b + 1])
        return cls(q, kv, starts, page_table.to(torch.int32), slot_mapping, max(q_lens),
                   max(kv_lens))

    @classmethod
    def from_lists(
        cls,
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        slot_mapping: torch.Tensor,
    ) -> AttentionBatch:
        """A batch from per-sequence page lists (padded with page 0), on ``slot_mapping``'s
        device."""
        width = max(1, max(len(pt) for pt in page_tables))
        rows = [list(pt) + [0] * (width - len(pt)) for pt in page_tables]
        table = torch.tensor(rows, dtype=torch.int32).to(slot_mapping.device)
        return cls.build(q_lens, kv_lens, table, slot_mapping)


class AttentionBackend(ABC):
    """Computes attention for one forward; :meth:`prepare` runs once, :meth:`forward` per layer."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None:
        """Build the metadata of one forward (gather indices, masks) from ``batch``."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """Store ``k, v`` ``[T, kv_heads, D]`` of local layer ``layer`` and attend ``q``
        ``[T, heads, D]``; returns ``[T, heads, D]``."""


# Rows of several tokens fold a kv head's query heads into its query rows when that makes at
# most this many rows per kv head. On this project's CPU, SDPA's enable_gqa path (which repeats
# the keys per query head) took about a fifth longer at a verify's 2 x 5 rows; from 32 rows on
# the fold gained nothing, and from 128 (prefill chunks) it took about a tenth longer
FOLD_ROWS = 16


class TorchPagedAttention(AttentionBackend):
    """Gathers each sequence's pages into a padded batch and runs one SDPA call per layer.

    K/V are gathered a page at a time (``index_select`` over ``[num_pages, page_size * ...]``
    rows), so a sequence's keys are its pages laid end to end: ``S = max_pages * page_size``
    key positions per sequence, of which the mask admits the first ``kv_len``.
    """

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        # [num_slots, kv_heads, D] views of each layer's buffers, for writes by slot
        self.flat_k = [pool.flat_k(i) for i in range(pool.num_layers)]
        self.flat_v = [pool.flat_v(i) for i in range(pool.num_layers)]
        self._keys: torch.Tensor | None = None  # the last key positions [1, 1, 1, S] built
        self._grouped: torch.Tensor | None = None  # this forward's mask per kv head's rows

    def prepare(self, batch: AttentionBatch) -> None:
        ps = self.pool.page_size
        bsz, max_q = batch.num_seqs, batch.max_q
        max_pages = -(-batch.max_kv // ps)
        self.bsz, self.max_q = bsz, max_q
        self._grouped = None
        table = batch.page_table
        if table.shape[1] != max_pages:
            table = table[:, :max_pages]
        self.pages = table.reshape(-1)  # [B * max_pages]
        self.slot_mapping = batch.slot_mapping
        keys = self._key_positions(max_pages * ps, batch.kv_lens)  # [1, 1, 1, S]
        kv_len = batch.kv_lens.view(bsz, 1, 1, 1)
        tree = None if batch.tree_mask is None else tree_key_mask(keys, kv_len, batch.tree_mask)
        if max_q == 1:
            self.q_index = None
            self.out_index = None
            self.mask = keys < kv_len if tree is None else tree  # [B, 1, 1, S]
            return
        q_len = batch.q_lens.view(bsz, 1, 1, 1)
        rows = torch.arange(max_q, device=keys.device).view(1, 1, max_q, 1)
        # mask: [B, 1, max_q, S] causal inside each sequence; padded rows see key 0 only
        self.mask = (keys <= kv_len - q_len + rows) & (keys < kv_len) if tree is None else tree
        if batch.uniform:  # verify, draft extend, one prefill chunk
            self.q_index = self.out_index = None  # the rows are already [B, max_q] in order
            return
        r = rows.view(1, max_q)
        q_len2 = batch.q_lens.view(bsz, 1)
        self.q_index = batch.q_starts[:-1].view(bsz, 1) + torch.minimum(r, q_len2 - 1)
        valid = (r < q_len2).flatten()
        self.out_index = valid.nonzero().squeeze(1)

    def _key_positions(self, span: int, kv_lens: torch.Tensor) -> torch.Tensor:
        """``0 .. span - 1`` as ``[1, 1, 1, span]``, in ``kv_lens``' dtype and device. Kept
        between forwards: consecutive decode steps mostly share their span (it grows a page at
        a time), so most steps build no tensor here."""
        keys = self._keys
        if (keys is None or keys.shape[3] != span or keys.dtype != kv_lens.dtype
                or keys.device != kv_lens.device):
            keys = torch.arange(span, dtype=kv_lens.dtype, device=kv_lens.device)
            keys = self._keys = keys.view(1, 1, 1, span)
        return keys

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        self.flat_k[layer].index_copy_(0, self.slot_mapping, k)
        self.flat_v[layer].index_copy_(0, self.slot_mapping, v)
        bsz, heads, dim = self.bsz, q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        shape = (bsz, -1, kv_heads, dim)
        keys = self.pool.k[layer].index_select(0, self.pages).view(shape).transpose(1, 2)
        vals = self.pool.v[layer].index_select(0, self.pages).view(shape).transpose(1, 2)
        # keys, vals: [B, kv_heads, S, D]
        if self.max_q == 1:
            # decode: a kv head's query heads play the role of query rows, so no GQA expansion
            qq = q.view(bsz, kv_heads, -1, dim)  # [B, kv_heads, heads / kv_heads, D]
            out = F.scaled_dot_product_attention(qq, keys, vals, attn_mask=self.mask)
            return out.reshape(bsz, heads, dim)
        group, max_q = heads // kv_heads, self.max_q
        rows = q.view(bsz, max_q, heads, dim) if self.q_index is None else q[self.q_index]
        if group * max_q > FOLD_ROWS:
            out = F.scaled_dot_product_attention(rows.transpose(1, 2), keys, vals,
                                                 attn_mask=self.mask, enable_gqa=True)
            out = out.transpose(1, 2).reshape(-1, heads, dim)  # [B * max_q, heads, D]
            return out if self.out_index is None else out[self.out_index]
        # a few rows (verify, draft extend): as for decode, a kv head's (query head, row) pairs
        # are its query rows, [B, kv_heads, group * max_q, D] against its own keys
        qq = rows.view(bsz, max_q, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            qq.reshape(bsz, kv_heads, group * max_q, dim), keys, vals,
            attn_mask=self._group_mask(group))
        out = out.view(bsz, kv_heads, group, max_q, dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(-1, heads, dim)  # [B * max_q, heads, D]
        return out if self.out_index is None else out[self.out_index]

    def _group_mask(self, group: int) -> torch.Tensor:
        """The mask ``[B, 1, max_q, S]`` repeated for each of a kv head's ``group`` query heads,
        ``[B, 1, group * max_q, S]``; built on a forward's first layer, kept for the others (a
        pool's layers share their head counts)."""
        if self._grouped is None:
            bsz, _, max_q, span = self.mask.shape
            mask = self.mask.unsqueeze(2).expand(bsz, 1, group, max_q, span)
            self._grouped = mask.reshape(bsz, 1, group * max_q, span)
        return self._grouped


def tree_key_mask(keys: torch.Tensor, kv_len: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
    """The ``[B, 1, max_q, S]`` mask of a tree-masked batch: key positions ``keys``
    ``[1, 1, 1, S]``, lengths ``kv_len`` ``[B, 1, 1, 1]``, ``tree`` ``[B, max_q, W]`` (see
    :attr:`AttentionBatch.tree_mask`)."""
    bsz, max_q, width = tree.shape
    w = keys - (kv_len - width)  # [B, 1, 1, S] index of each key in the window (< 0: before)
    index = w.clamp(0, width - 1).long().expand(bsz, 1, max_q, -1)
    inside = tree.unsqueeze(1).gather(3, index)  # [B, 1, max_q, S]
    return (w < 0) | (inside & (keys < kv_len))
