"""TritonPagedAttention against TorchPagedAttention, on CPU through the Triton interpreter.

Both backends get identical pools (same random contents, including stale data in unused
slots) and the same batch; the written K/V must be byte-equal and the outputs close. Page
tables are shuffled (pages out of order, last page partly filled). ``TRITON_INTERPRET`` is set
before triton is first imported, since Triton fixes the mode when a kernel is defined.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention.backend import AttentionBatch, TorchPagedAttention  # noqa: E402
from engine.kv.pool import KVPool, slot_of  # noqa: E402

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("needs TRITON_INTERPRET=1 to run Triton on CPU", allow_module_level=True)

from engine.attention.triton_backend import TritonPagedAttention, decode_splits  # noqa: E402

NUM_PAGES = 64
LAYERS = 2
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def twin_pools(page_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> list[KVPool]:
    """Two pools with the same random contents."""
    gen = torch.Generator().manual_seed(1)
    pools = [KVPool(NUM_PAGES, page_size, kv_heads, dim, list(range(LAYERS)), dtype)
             for _ in range(2)]
    for buf_a, buf_b in zip(pools[0].entries(), pools[1].entries(), strict=True):
        buf_a.copy_(torch.randn(buf_a.shape, generator=gen))
        buf_b.copy_(buf_a)
    return pools


def page_lists(kv_lens: list[int], page_size: int, gen: torch.Generator) -> list[list[int]]:
    """Distinct pages per sequence, drawn in shuffled order from the whole pool."""
    order = torch.randperm(NUM_PAGES, generator=gen).tolist()
    out = []
    for n in kv_lens:
        count = -(-n // page_size)
        out.append(order[:count])
        order = order[count:]
    return out


def make_batch(
    q_lens: list[int], kv_lens: list[int], page_size: int, seed: int = 0, width: int = 0
) -> AttentionBatch:
    """A batch whose new tokens are each sequence's last ``q_len`` positions; page-table rows
    are padded with page 0 to ``width`` columns (at least the longest row)."""
    tables = page_lists(kv_lens, page_size, torch.Generator().manual_seed(seed))
    slots = [slot_of(pages[pos // page_size], page_size, pos % page_size)
             for q, n, pages in zip(q_lens, kv_lens, tables, strict=True)
             for pos in range(n - q, n)]
    width = max(width, *(len(t) for t in tables))
    tables = [t + [0] * (width - len(t)) for t in tables]
    return AttentionBatch.from_lists(q_lens, kv_lens, tables, torch.tensor(slots))


def qkv(
    tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views into one ``[T, heads + 2 kv_heads, D]`` tensor, as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    return x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]


def forward_both(pools: list[KVPool], batch: AttentionBatch, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, max_splits: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1 of both backends over ``batch`` on twin ``pools`` (torch's, Triton's), checked to
    write the same slots; ``(torch output, Triton output)``."""
    ref_pool, tri_pool = pools
    ref, tri = TorchPagedAttention(ref_pool), TritonPagedAttention(tri_pool, max_splits)
    ref.prepare(batch)
    tri.prepare(batch)
    want = ref.forward(q, k, v, 1)
    got = tri.forward(q, k, v, 1)
    for a, b in zip(ref_pool.entries(), tri_pool.entries(), strict=True):
        assert torch.equal(a, b)
    return want, got


def check(
    q_lens: list[int], kv_lens: list[int], heads: int, kv_heads: int, *, page_size: int = 16,
    dim: int = 16, dtype: torch.dtype = torch.float32, max_splits: int = 16,
) -> None:
    """Both backends on twin pools, layer 1 of 2: same slots written, outputs close."""
    pools = twin_pools(page_size, kv_heads, dim, dtype)
    batch = make_batch(q_lens, kv_lens, page_size)
    q, k, v = qkv(sum(q_lens), heads, kv_heads, dim, dtype)
    want, got = forward_both(pools, batch, q, k, v, max_splits)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("page_size", [16, 4])
def test_prefill_ragged(page_size: int) -> None:
    check([5, 19, 1], [5, 19, 1], 4, 2, page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 4])
def test_mixed_prefill_chunks_and_decode_rows(page_size: int) -> None:
    check([7, 1, 12, 1], [75, 33, 12, 6], 4, 2, page_size=page_size)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("max_splits", [16, 1])
def test_decode_gqa(heads: int, kv_heads: int, page_size: int, max_splits: int) -> None:
    check([1, 1, 1], [1, 19, 70], heads, kv_heads, page_size=page_size, max_splits=max_splits)


@pytest.mark.parametrize("page_size", [16, 4])
def test_verify_window(page_size: int) -> None:
    check([4, 4, 4], [4, 21, 37], 4, 2, page_size=page_size)


def test_head_dim_32_without_grouping() -> None:
    check([3, 9], [10, 9], 2, 2, dim=32, page_size=8)


@pytest.mark.parametrize(
    ("q_lens", "kv_lens", "heads", "kv_heads"),
    [([6, 1, 3], [6, 17, 40], 4, 2), ([1, 1], [9, 30], 8, 1), ([3, 3], [3, 18], 4, 2)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(
    q_lens: list[int], kv_lens: list[int], heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    check(q_lens, kv_lens, heads, kv_heads, dtype=dtype, page_size=4)


@pytest.mark.parametrize("q_len", [1, 4])
def test_replay_with_new_lengths_in_place(q_len: int) -> None:
    """A graph replay: prepare once, refill the batch tensors in place with longer sequences
    and new pages, run forward again; the kernels must follow the device values."""
    kv_heads, heads, dim, ps = 2, 4, 16, 4
    ref_pool, tri_pool = twin_pools(ps, kv_heads, dim, torch.float32)
    first = make_batch([q_len] * 3, [q_len, 6, 9], ps, seed=3, width=12)
    second = make_batch([q_len] * 3, [30, q_len + 2, 45], ps, seed=4, width=12)
    tri = TritonPagedAttention(tri_pool)
    tri.prepare(first)
    tri.forward(*qkv(3 * q_len, heads, kv_heads, dim, torch.float32, seed=5), 0)
    ref = TorchPagedAttention(ref_pool)
    ref.prepare(first)
    ref.forward(*qkv(3 * q_len, heads, kv_heads, dim, torch.float32, seed=5), 0)
    for name in ("q_lens", "kv_lens", "q_starts", "page_table", "slot_mapping"):
        getattr(first, name).copy_(getattr(second, name))
    q, k, v = qkv(3 * q_len, heads, kv_heads, dim, torch.float32, seed=6)
    got = tri.forward(q, k, v, 0)  # no prepare: first's max_kv is stale on purpose
    ref.prepare(second)
    want = ref.forward(q, k, v, 0)
    for a, b in zip(ref_pool.entries(), tri_pool.entries(), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_splits_depend_on_launch_shape_only() -> None:
    assert decode_splits(1, 2, 16) == 16
    assert decode_splits(64, 8, 16) == 1
    assert decode_splits(3, 2, 4) == 4


def test_bad_inputs_are_refused() -> None:
    pool = KVPool(4, 4, 2, 16, [0])
    tri = TritonPagedAttention(pool)
    q, k, v = qkv(2, 4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="before prepare"):
        tri.forward(q, k, v, 0)
    tri.prepare(make_batch([1, 1], [3, 5], 4))
    with pytest.raises(ValueError, match="k and v must be"):
        tri.forward(q, k[:, :1], v, 0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        tri.forward(q[:, :3], k, v, 0)
    with pytest.raises(ValueError, match="q must be"):
        tri.forward(q[:1], k, v, 0)
    with pytest.raises(ValueError, match="max_splits"):
        TritonPagedAttention(pool, 0)


@pytest.mark.parametrize(("q_len", "width"), [(4, 4), (3, 6), (1, 3)])
def test_tree_mask(q_len: int, width: int) -> None:
    """Draft-tree attention (a verify window of ``q_len`` nodes; a draft forward of ``q_len``
    rows over a wider window of earlier rows): random masks, each row seeing at least its own
    key; both backends agree."""
    kv_heads, heads, dim, ps = 2, 4, 16, 4
    kv_lens = [width, 13, 30]
    pools = twin_pools(ps, kv_heads, dim, torch.float32)
    tree = torch.rand(3, q_len, width, generator=torch.Generator().manual_seed(5)) > 0.5
    tree[:, torch.arange(q_len), width - q_len + torch.arange(q_len)] = True  # its own key
    base = make_batch([q_len] * 3, kv_lens, ps)
    batch = AttentionBatch(base.q_lens, base.kv_lens, base.q_starts, base.page_table,
                           base.slot_mapping, base.max_q, base.max_kv, tree)
    q, k, v = qkv(3 * q_len, heads, kv_heads, dim, torch.float32)
    want, got = forward_both(pools, batch, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
