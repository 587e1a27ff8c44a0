"""Triton kernels of paged attention: K/V are read through the page table, never gathered.

Layout (see :mod:`engine.kv.pool`): a layer's K or V buffer is ``[num_pages, page_size,
kv_heads, D]``; key ``n`` of sequence ``b`` lives at slot ``page_table[b, n // page_size] *
page_size + n % page_size``. Query ``i`` of sequence ``b`` (``q_len`` new tokens on top of
``kv_len - q_len`` cached ones) sees keys ``0 .. kv_len - q_len + i``.

Two entry points, both launched with grids that depend only on the batch size, ``max_q`` and
head counts; every sequence's length is read inside the kernels, so a captured CUDA graph
replays correctly with new ``kv_lens`` and page tables. With a tree mask (EAGLE draft trees,
extend only) query ``i`` instead sees every key before the sequence's last ``W`` and those of the
last ``W`` its row of the ``[B, max_q, W]`` mask admits:

- :func:`extend_attention`: ragged prefill chunks, mixed batches and verify windows. One
  program per (block of ``BLOCK_Q`` queries (tile sizes per dtype and head dim:
  :mod:`engine.attention.kernels.configs`), sequence, kv head); the query heads of a kv head
  are stacked into the rows of one tile (row ``r`` is query ``r // GROUP_PAD``, head
  ``r % GROUP_PAD``), so each K/V tile is loaded once for the whole group.
- :func:`decode_attention`: one query per sequence. One program per (sequence, kv head,
  split); the key range is cut into ``num_splits`` parts whose partial results a second kernel
  merges by their log-sum-exp.

Scores and the online softmax are float32 (base-2 exponentials, the scale folded with
``log2(e)``); K/V stay in the pool's dtype. ``D`` is padded to a power of two >= 16 with masks.
The kernels are built when this module is imported: with ``TRITON_INTERPRET=1`` set then, they
run on CPU tensors through the interpreter.

Both entry points are torch custom ops (``pdserve::extend_attention``,
``pdserve::decode_attention``) that write ``out`` in place, with a fake implementation that does
nothing: so traced forwards (meta or fake tensors, and the compiler) see them as opaque calls
with known effects, and the GPU-readiness suite can trace a whole captured forward on ``meta``
tensors without a GPU (``tests/gpu_readiness/test_capture_regions.py``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.attention.kernels.configs import decode_launch, extend_launch, next_power_of_2

_INTERPRETED = bool(triton.knobs.runtime.interpret)
_LOG2E = 1.4426950408889634


@triton.jit
def _attend(  # type: ignore[no-untyped-def]  # a Triton function: no Python annotations
    acc, m_i, l_i,  # running state: [M, D_PAD] f32, [M] f32, [M] f32
    q,  # [M, D_PAD] in the pool's dtype
    last,  # [M] int32, last key index each row may see (without TREE)
    tree_rows,  # [M] pointers to each row's tree-mask row (TREE), read where row_ok
    row_ok,  # [M] bool
    win,  # first key of the tree window (TREE)
    k_ptr, v_ptr, pt_row, kvh, lo, hi, kv_len, scale,
    stride_ks, stride_kh,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr, TREE: tl.constexpr,
):
    """Fold keys ``lo .. hi-1`` (below ``kv_len``) into the online-softmax state; with
    ``DOT_F32`` both products take float32 operands; with ``TREE`` a row sees the keys before
    ``win`` and the window keys its mask row admits, else the keys up to its ``last``."""
    if DOT_F32:
        q = q.to(tl.float32)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_len
        page = tl.load(pt_row + n // PAGE_SIZE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE
        off = slot * stride_ks + kvh * stride_kh  # [BLOCK_N] int64
        kt = tl.load(k_ptr + off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                     other=0.0)  # [D_PAD, BLOCK_N]
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee") * scale  # [M, BLOCK_N] f32, log2 domain
        if TREE:
            w = n[None, :] - win  # [1, BLOCK_N] index in the window (< 0: before it)
            inside = (w >= 0) & n_ok[None, :] & row_ok[:, None]
            bit = tl.load(tree_rows[:, None] + w, mask=inside, other=0)  # [M, BLOCK_N]
            seen = n_ok[None, :] & ((w < 0) | (bit != 0))
        else:
            seen = n_ok[None, :] & (n[None, :] <= last[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BLOCK_N, D_PAD]
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


# A batch's lengths, page table and tree mask specialise nothing: their row strides follow
# the batch (its pages, its window) and their addresses its size (AttentionBatch.build packs
# the lengths in one array), so any batch reuses the kernel compiled for its tile (what the
# start-up warm-up compiles: engine/runner/kernel_warmup.py).
_BATCH_POINTERS = ["q_starts", "kv_lens", "page_table", "tree_mask"]


@triton.jit(do_not_specialize=["stride_pt", "stride_tb", "stride_tq"],
            do_not_specialize_on_alignment=_BATCH_POINTERS)
def _extend_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, o_ptr, q_starts, kv_lens, page_table, tree_mask, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_pt,
    stride_tb, stride_tq,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr, TREE: tl.constexpr, WINDOW: tl.constexpr,
):
    qb = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(q_starts + b)
    q_len = tl.load(q_starts + b + 1) - q_start
    kv_len = tl.load(kv_lens + b)
    ctx = kv_len - q_len  # keys cached before this forward
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = qb * BLOCK_Q + r // GROUP_PAD  # query index inside the sequence
    g = r % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    io_mask = row_ok[:, None] & (d < D)[None, :]
    tok = (q_start + qi).to(tl.int64)
    head = kvh * GROUP + g
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=io_mask, other=0.0)
    # keys past the last query of this block are never seen (causal; a tree row may see any
    # key of the window); an empty block loops zero times
    if TREE:
        hi = kv_len
    else:
        hi = tl.minimum(kv_len, ctx + (qb + 1) * BLOCK_Q)
    hi = tl.where(qb * BLOCK_Q < q_len, hi, 0)
    tree_rows = tree_mask + b.to(tl.int64) * stride_tb + qi.to(tl.int64) * stride_tq
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, ctx + qi, tree_rows, row_ok, kv_len - WINDOW,
                            k_ptr, v_ptr, page_table + b * stride_pt,
                            kvh, 0, hi, kv_len, scale, stride_ks, stride_kh,
                            D, D_PAD, BLOCK_N, PAGE_SIZE, DOT_F32, TREE)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(o_ptr + (tok * stride_ot + head * stride_oh)[:, None] + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["stride_pt"], do_not_specialize_on_alignment=_BATCH_POINTERS[1:3])
def _decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, o_ptr, part_o, part_lse, kv_lens, page_table, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_pt, num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens + b)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    d = tl.arange(0, D_PAD)
    io_mask = g_ok[:, None] & (d < D)[None, :]
    head = kvh * GROUP + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + (head * stride_qh)[:, None] + d[None, :],
                mask=io_mask, other=0.0)
    # split s covers keys [s * per_split, (s + 1) * per_split), whole BLOCK_N steps
    per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    last = tl.full([GROUP_PAD], 0, dtype=tl.int32) + kv_len - 1
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, last, page_table, g_ok, 0,
                            k_ptr, v_ptr, page_table + b * stride_pt,
                            kvh, lo, hi, kv_len, scale, stride_ks, stride_kh,
                            D, D_PAD, BLOCK_N, PAGE_SIZE, DOT_F32, False)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + b.to(tl.int64) * stride_ot + (head * stride_oh)[:, None] + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=io_mask)
    else:
        row = (b * num_heads + head).to(tl.int64) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_o + row[:, None] * D_PAD + d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse + row, lse, mask=g_ok)


@triton.jit
def _merge_kernel(  # type: ignore[no-untyped-def]
    o_ptr, part_o, part_lse, stride_ot, stride_oh, num_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    row = (b * num_heads + h).to(tl.int64) * NUM_SPLITS + s
    lse = tl.load(part_lse + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no keys at all: the output is 0
    w = tl.exp2(lse - top)  # [SPLITS_PAD], 0 for empty splits
    part = tl.load(part_o + row[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(o_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + d,
             out.to(o_ptr.dtype.element_ty), mask=d < D)


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError(
            f"Triton paged attention needs CUDA tensors (got {q.device}), or TRITON_INTERPRET=1 "
            "set before engine.attention.kernels.paged_attention is imported; use "
            "TorchPagedAttention"
        )


def _dot_f32(q: torch.Tensor) -> bool:
    """Whether to upcast the products' operands: only in the interpreter, whose ``tl.dot``
    multiplies bfloat16 tiles as their raw 16-bit patterns (Triton 3.9)."""
    return _INTERPRETED and q.dtype == torch.bfloat16


def _dtype_name(q: torch.Tensor) -> str:
    return str(q.dtype).removeprefix("torch.")


def _kv_strides(k_buf: torch.Tensor, v_buf: torch.Tensor) -> tuple[int, int]:
    """Slot and head strides of a ``[num_pages, page_size, kv_heads, D]`` buffer pair."""
    if k_buf.stride() != v_buf.stride() or not k_buf.is_contiguous():
        raise ValueError("K and V buffers must be contiguous with equal strides")
    return k_buf.stride(1), k_buf.stride(2)


@torch.library.custom_op("pdserve::extend_attention", mutates_args=("out",))
def extend_attention(
    q: torch.Tensor,  # [T, heads, D], pool dtype, last dim contiguous
    k_buf: torch.Tensor,  # [num_pages, page_size, kv_heads, D]
    v_buf: torch.Tensor,  # [num_pages, page_size, kv_heads, D]
    out: torch.Tensor,  # [T, heads, D], written
    q_starts: torch.Tensor,  # [B + 1] int32
    kv_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, P] int32, contiguous
    max_q: int,
    tree_mask: torch.Tensor | None = None,  # [B, max_q, W] bool, contiguous
) -> None:
    """Causal attention of ragged query runs over their paged keys (prefill, extend, verify),
    or under a draft tree's ``tree_mask`` (see the module docstring).

    The grid is ``(ceil(max_q / BLOCK_Q), B, kv_heads)``: it depends on nothing else, so a
    uniform batch (verify) is graph-capturable. Rows of a sequence past its ``q_len`` are
    neither read nor written.
    """
    _check_device(q)
    _, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_buf.shape
    group = heads // kv_heads
    stride_ks, stride_kh = _kv_strides(k_buf, v_buf)
    cfg = extend_launch(_dtype_name(q), dim, group, max_q)  # tile sizes: see configs.py
    grid = (triton.cdiv(max_q, cfg.block_q), page_table.shape[0], kv_heads)
    # the mask as bytes (a bool tensor's storage); without one, a placeholder never read
    tree = page_table if tree_mask is None else tree_mask.contiguous().view(torch.uint8)
    _extend_kernel[grid](
        q, k_buf, v_buf, out, q_starts, kv_lens, page_table, tree, _LOG2E / math.sqrt(dim),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_ks, stride_kh,
        page_table.stride(0), tree.stride(0), tree.stride(1),
        GROUP=group, GROUP_PAD=cfg.group_pad, BLOCK_Q=cfg.block_q,
        D=dim, D_PAD=cfg.d_pad, BLOCK_N=cfg.block_n, PAGE_SIZE=page_size,
        DOT_F32=_dot_f32(q), TREE=tree_mask is not None,
        WINDOW=0 if tree_mask is None else tree_mask.shape[2],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@extend_attention.register_fake
def _extend_attention_fake(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                           out: torch.Tensor, q_starts: torch.Tensor, kv_lens: torch.Tensor,
                           page_table: torch.Tensor, max_q: int,
                           tree_mask: torch.Tensor | None = None) -> None:
    """Traced: ``out`` is written in place, nothing is returned."""


@torch.library.custom_op("pdserve::decode_attention", mutates_args=("out",))
def decode_attention(
    q: torch.Tensor,  # [B, heads, D], pool dtype, last dim contiguous
    k_buf: torch.Tensor,  # [num_pages, page_size, kv_heads, D]
    v_buf: torch.Tensor,  # [num_pages, page_size, kv_heads, D]
    out: torch.Tensor,  # [B, heads, D], written
    kv_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, P] int32, contiguous
    num_splits: int,
) -> None:
    """Attention of one query per sequence over all of its ``kv_len`` keys, split-K.

    Grids ``(B, kv_heads, num_splits)`` and, when ``num_splits > 1``, ``(B, heads)`` for the
    merge; the float32 partial results live in scratch tensors allocated here.
    """
    _check_device(q)
    bsz, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_buf.shape
    group = heads // kv_heads
    cfg = decode_launch(_dtype_name(q), dim, group)  # tile sizes: see configs.py
    d_pad = cfg.d_pad
    stride_ks, stride_kh = _kv_strides(k_buf, v_buf)
    part_o = part_lse = out  # unused placeholders when there is one split
    if num_splits > 1:
        part_o = torch.empty(bsz, heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(bsz, kv_heads, num_splits)](
        q, k_buf, v_buf, out, part_o, part_lse, kv_lens, page_table, _LOG2E / math.sqrt(dim),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_ks, stride_kh,
        page_table.stride(0), heads,
        GROUP=group, GROUP_PAD=cfg.group_pad,
        NUM_SPLITS=num_splits, D=dim, D_PAD=d_pad, BLOCK_N=cfg.block_n, PAGE_SIZE=page_size,
        DOT_F32=_dot_f32(q), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(bsz, heads)](
            out, part_o, part_lse, out.stride(0), out.stride(1), heads,
            NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits),
            D=dim, D_PAD=d_pad,
        )


@decode_attention.register_fake
def _decode_attention_fake(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                           out: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                           num_splits: int) -> None:
    """Traced: ``out`` is written in place, nothing is returned."""
