"""Paged attention with Triton kernels (:mod:`engine.attention.kernels.paged_attention`), for CUDA.

Same contract as :class:`engine.attention.backend.TorchPagedAttention`: ``forward`` writes the new
K/V at the batch's slots, then attends causally (or under the batch's tree mask, through the extend
kernel) through the page table. Importing this module needs ``triton``; on CPU tensors the
kernels run only under ``TRITON_INTERPRET=1``.

CUDA graphs: ``prepare`` reads nothing from the device and allocates nothing; ``forward``'s
launches depend only on the batch size, ``max_q``, head counts, ``D`` and the page size (never
on ``max_kv``), and every kernel reads the sequence lengths and page table from the device.
So a graph captured for a uniform batch (decode, verify, draft extend) replays correctly after
its ``kv_lens``, ``q_starts``, ``page_table`` and ``slot_mapping`` buffers are refilled in place.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionBatch
from engine.attention.kernels.configs import decode_splits
from engine.attention.kernels.paged_attention import decode_attention, extend_attention
from engine.kv.pool import KVPool

__all__ = ["TritonPagedAttention", "decode_splits"]


class TritonPagedAttention(AttentionBackend):
    """Triton paged attention: a decode kernel for one query per sequence, an extend kernel
    for everything else (prefill chunks, mixed batches, verify windows).

    Works in the pool's dtype (q, k, v are cast to it when they differ), accumulates in
    float32 and returns ``q``'s dtype. ``max_splits`` bounds the split-K factor of decode.
    """

    def __init__(self, pool: KVPool, max_splits: int = 16) -> None:
        super().__init__(pool)
        if max_splits < 1:
            raise ValueError(f"max_splits must be at least 1, got {max_splits}")
        self.max_splits = max_splits
        # [num_slots, kv_heads, D] views of each layer's buffers, for writes by slot
        self.flat_k = [pool.flat_k(i) for i in range(pool.num_layers)]
        self.flat_v = [pool.flat_v(i) for i in range(pool.num_layers)]
        self.batch: AttentionBatch | None = None

    def prepare(self, batch: AttentionBatch) -> None:
        """Keep ``batch``'s tensors for the layers; checks shapes only, reads no device data."""
        bsz = batch.num_seqs
        if batch.kv_lens.shape != (bsz,) or batch.q_starts.shape != (bsz + 1,):
            raise ValueError(
                f"kv_lens must be [{bsz}] and q_starts [{bsz + 1}], got "
                f"{tuple(batch.kv_lens.shape)} and {tuple(batch.q_starts.shape)}"
            )
        if batch.page_table.dim() != 2 or batch.page_table.shape[0] != bsz:
            raise ValueError(f"page_table must be [{bsz}, P], got {tuple(batch.page_table.shape)}")
        tree = batch.tree_mask
        if tree is not None and (tree.dim() != 3 or tuple(tree.shape[:2]) != (bsz, batch.max_q)
                                 or tree.dtype != torch.bool):
            raise ValueError(f"tree_mask must be a [{bsz}, {batch.max_q}, W] bool tensor, got "
                             f"{tuple(tree.shape)} {tree.dtype}")
        if batch.max_q < 1:
            raise ValueError(f"a forward needs at least one new token, got max_q={batch.max_q}")
        for name, t in (("q_lens", batch.q_lens), ("kv_lens", batch.kv_lens),
                        ("q_starts", batch.q_starts), ("page_table", batch.page_table)):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 tensor, got {t.dtype}")
        if batch.page_table.device != self.pool.device:
            raise ValueError(
                f"batch tensors are on {batch.page_table.device}, the pool on {self.pool.device}"
            )
        self.batch = batch

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        batch = self.batch
        if batch is None:
            raise RuntimeError("TritonPagedAttention.forward called before prepare")
        self._check(q, k, v, batch)
        dtype = self.pool.dtype
        self.flat_k[layer].index_copy_(0, batch.slot_mapping, k.to(dtype))
        self.flat_v[layer].index_copy_(0, batch.slot_mapping, v.to(dtype))
        qq = q.to(dtype)
        if qq.stride(2) != 1:
            qq = qq.contiguous()
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        k_buf, v_buf = self.pool.k[layer], self.pool.v[layer]
        if batch.max_q == 1 and batch.uniform and batch.tree_mask is None:
            splits = decode_splits(batch.num_seqs, self.pool.num_kv_heads, self.max_splits)
            decode_attention(qq, k_buf, v_buf, out, batch.kv_lens, batch.page_table, splits)
        else:
            extend_attention(qq, k_buf, v_buf, out, batch.q_starts, batch.kv_lens,
                             batch.page_table, batch.max_q, batch.tree_mask)
        return out.to(q.dtype)

    def _check(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> None:
        pool = self.pool
        t = batch.num_tokens
        kv_shape = (t, pool.num_kv_heads, pool.head_dim)
        if tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape:
            raise ValueError(
                f"k and v must be {list(kv_shape)} (tokens, kv heads, head dim), got "
                f"{list(k.shape)} and {list(v.shape)}"
            )
        if q.dim() != 3 or q.shape[0] != t or q.shape[2] != pool.head_dim:
            raise ValueError(f"q must be [{t}, heads, {pool.head_dim}], got {list(q.shape)}")
        if q.shape[1] % pool.num_kv_heads != 0:
            raise ValueError(
                f"query heads ({q.shape[1]}) must be a multiple of kv heads ({pool.num_kv_heads})"
            )
