"""AttentionBatch.build and TorchPagedAttention against definitions computed the slow way.

``build``'s lengths are checked against the lists they came from; the backend's output against
a dense causal SDPA over each sequence's keys read token by token through ``slot_of``, for
decode, uniform (verify) and ragged (prefill + decode) batches. One backend instance serves
every batch in turn, so what it keeps between forwards (the key positions) must never leak
into the next one: its output equals a fresh instance's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBatch, TorchPagedAttention
from engine.kv.pool import KVPool, slot_of

PS, PAGES, HEADS, KV_HEADS, DIM = 4, 32, 4, 2, 8


def _pool(seed: int) -> KVPool:
    pool = KVPool(PAGES, PS, KV_HEADS, DIM, [0], torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.entries():
        buf.copy_(torch.randn(buf.shape, generator=gen))
    return pool


def _batch(q_lens: list[int], kv_lens: list[int], seed: int) -> AttentionBatch:
    order = torch.randperm(PAGES, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, slots = [], []
    for q, n in zip(q_lens, kv_lens, strict=True):
        pages, order = order[: -(-n // PS)], order[-(-n // PS) :]
        tables.append(pages)
        slots += [slot_of(pages[p // PS], PS, p % PS) for p in range(n - q, n)]
    return AttentionBatch.from_lists(q_lens, kv_lens, tables, torch.tensor(slots))


def _dense(pool: KVPool, batch: AttentionBatch, q: torch.Tensor) -> torch.Tensor:
    """Causal attention of each sequence's new rows over its tokens, one sequence at a time."""
    out, row = [], 0
    k_flat, v_flat = pool.flat_k(0), pool.flat_v(0)
    for b in range(batch.num_seqs):
        ql, kl = int(batch.q_lens[b]), int(batch.kv_lens[b])
        pages = batch.page_table[b].tolist()
        slots = torch.tensor([slot_of(pages[p // PS], PS, p % PS) for p in range(kl)])
        keys = k_flat[slots].transpose(0, 1)  # [kv_heads, kl, D]
        vals = v_flat[slots].transpose(0, 1)
        mask = torch.arange(kl)[None, :] <= torch.arange(kl - ql, kl)[:, None]  # [ql, kl]
        qq = q[row : row + ql].transpose(0, 1)  # [heads, ql, D]
        o = F.scaled_dot_product_attention(qq, keys, vals, attn_mask=mask, enable_gqa=True)
        out.append(o.transpose(0, 1))
        row += ql
    return torch.cat(out)


CASES = [
    ([1, 1, 1], [3, 9, 17]),  # decode
    ([1, 1, 1], [4, 10, 18]),  # decode, one token later: same span
    ([1, 1], [5, 24]),  # decode, wider span
    ([3, 3], [3, 11]),  # uniform: verify windows
    ([5, 1, 2], [5, 13, 7]),  # ragged: prefill chunks beside decode rows
    ([9, 9], [9, 21]),  # uniform, more rows than FOLD_ROWS per kv head
    ([12, 1], [12, 6]),  # ragged, more rows than FOLD_ROWS per kv head
]


def test_build_lengths_match_their_definitions() -> None:
    q_lens, kv_lens = [3, 1, 4, 1], [3, 9, 12, 2]
    table = torch.arange(12, dtype=torch.int64).view(4, 3)
    b = AttentionBatch.build(q_lens, kv_lens, table, torch.zeros(9, dtype=torch.int64))
    assert b.q_lens.tolist() == q_lens and b.kv_lens.tolist() == kv_lens
    assert b.q_starts.tolist() == [0, 3, 4, 8, 9]
    assert {b.q_lens.dtype, b.kv_lens.dtype, b.q_starts.dtype} == {torch.int32}
    assert b.page_table.dtype == torch.int32 and b.page_table.tolist() == table.tolist()
    assert (b.max_q, b.max_kv, b.num_tokens) == (4, 12, 9)


@pytest.mark.parametrize("seed", [0, 1])
def test_backend_equals_dense_attention_and_a_fresh_backend(seed: int) -> None:
    pool, fresh_pool = _pool(seed), _pool(seed)
    kept = TorchPagedAttention(pool)  # one instance over every case, as in a serving loop
    gen = torch.Generator().manual_seed(seed + 10)
    for i, (q_lens, kv_lens) in enumerate(CASES):
        batch = _batch(q_lens, kv_lens, seed=seed + i)
        t = sum(q_lens)
        q = torch.randn(t, HEADS, DIM, generator=gen)
        k, v = torch.randn(2, t, KV_HEADS, DIM, generator=gen)
        kept.prepare(batch)
        got = kept.forward(q, k, v, 0)
        fresh = TorchPagedAttention(fresh_pool)
        fresh.prepare(batch)
        assert torch.equal(got, fresh.forward(q, k, v, 0))
        torch.testing.assert_close(got, _dense(pool, batch, q), atol=1e-5, rtol=1e-5)
