"""Static-buffer fills of the EAGLE verify / draft-extend forwards: the native and Triton twins
agree bit for bit (Triton under ``TRITON_INTERPRET=1`` on CPU), padded rows get their fill values,
rows past the padded batch are untouched, and the mrope buffer is refreshed on every fill.

``TRITON_INTERPRET`` is set only around each Triton call (``mock.patch.dict``), never for the
whole process: the Triton kernel is built lazily per interpreter mode, so nothing leaks into other
test modules.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_node.spec.fill import fill_draft_extend_prepare_buffers, select_backend
from decode_node.spec.fill_native import fill_draft_extend_prepare_buffers_native
from decode_node.spec.graph_buffers import SpecGraphBuffers

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
BACKENDS = ["native", pytest.param("triton", marks=needs_triton)]


@contextmanager
def interpret(on: bool) -> Iterator[None]:
    """``TRITON_INTERPRET`` set (or removed) for the duration of the block only."""
    with mock.patch.dict(os.environ):
        if on:
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.environ.pop("TRITON_INTERPRET", None)
        yield


def fill(bufs: SpecGraphBuffers, backend: str, src: dict[str, Any], **kw: Any) -> None:
    if backend == "triton":
        from decode_node.spec.fill_triton import fill_draft_extend_prepare_buffers_triton

        with interpret(True):
            fill_draft_extend_prepare_buffers_triton(bufs, **src, **kw)
    else:
        fill_draft_extend_prepare_buffers_native(bufs, **src, **kw)


def make_src(
    gen: torch.Generator,
    raw_bs: int,
    n: int,
    hidden: int,
    num_front_tokens: int,
    delta_range: int = 50,
) -> dict[str, torch.Tensor]:
    """Random sources for ``raw_bs`` requests of ``n`` tokens (deltas may be negative)."""
    t = raw_bs * n

    def ints(lo: int, hi: int, size: int) -> torch.Tensor:
        return torch.randint(lo, hi, (size,), generator=gen, dtype=torch.int64)

    ncd = ints(0, n - num_front_tokens, raw_bs)  # 0 <= ncd <= N-1-F
    return {
        "src_input_ids": ints(0, 1000, t),
        "src_positions": ints(0, 5000, t),
        "src_out_cache_loc": ints(1, 10_000, t),
        "src_hidden_states": torch.randn(t, hidden, generator=gen, dtype=torch.float32),
        "src_seq_lens": ints(1, 5000, raw_bs),
        "src_req_indices": ints(0, 64, raw_bs),
        "src_num_correct_drafts": ncd,
        "src_num_accept_tokens": ncd + 1,
        "src_temperatures": torch.rand(raw_bs, generator=gen, dtype=torch.float32) * 2,
        "src_mrope_deltas": ints(-delta_range, delta_range + 1, raw_bs),
    }


def garbage(bufs: SpecGraphBuffers, gen: torch.Generator) -> None:
    """Overwrite every buffer with random junk (negative values included)."""
    for t in bufs.tensors().values():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 1e3)
        else:
            t.copy_(torch.randint(-(2**40), 2**40, t.shape, generator=gen, dtype=t.dtype))


def clone(bufs: SpecGraphBuffers) -> SpecGraphBuffers:
    return SpecGraphBuffers(
        max_bs=bufs.max_bs,
        num_tokens_per_bs=bufs.num_tokens_per_bs,
        hidden_size=bufs.hidden_size,
        device=bufs.device,
        **{k: v.clone() for k, v in bufs.tensors().items()},
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, so float comparisons are exact (NaN and -0.0 included)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_bit_identical(a: SpecGraphBuffers, b: SpecGraphBuffers) -> None:
    tb = b.tensors()
    for name, t in a.tensors().items():
        assert torch.equal(bits(t), bits(tb[name])), name


# ------------------------------------------------------------------ native == Triton (property)


@needs_triton
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5),
    max_bs=st.integers(1, 5),
    data=st.data(),
    hidden=st.integers(1, 9),
    fill_value=st.integers(-1, 3000),
    pad_slot=st.integers(0, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_native_and_triton_agree_bit_for_bit(
    n: int,
    max_bs: int,
    data: st.DataObject,
    hidden: int,
    fill_value: int,
    pad_slot: int,
    seed: int,
) -> None:
    bs = data.draw(st.integers(1, max_bs), label="bs")
    raw_bs = data.draw(st.integers(0, bs), label="raw_bs")
    front = data.draw(st.integers(0, n - 1), label="num_front_tokens")
    gen = torch.Generator().manual_seed(seed)
    src = make_src(gen, raw_bs, n, hidden, front)
    src_before = {k: v.clone() for k, v in src.items()}
    native = SpecGraphBuffers.allocate(max_bs, n, hidden)
    garbage(native, gen)
    before = clone(native)
    triton_bufs = clone(native)
    kw = {"raw_bs": raw_bs, "bs": bs, "num_tokens_per_bs": n, "num_front_tokens": front,
          "seq_len_fill_value": fill_value, "pad_slot": pad_slot}

    fill(native, "native", src, **kw)
    fill(triton_bufs, "triton", src, **kw)

    assert_bit_identical(native, triton_bufs)
    assert all(torch.equal(src[k], src_before[k]) for k in src)  # sources untouched
    check_contract(before, native, src, **kw)


def check_contract(
    before: SpecGraphBuffers,
    after: SpecGraphBuffers,
    src: dict[str, torch.Tensor],
    *,
    raw_bs: int,
    bs: int,
    num_tokens_per_bs: int,
    num_front_tokens: int,
    seq_len_fill_value: int,
    pad_slot: int,
) -> None:
    """The documented semantics, element by element, independent of either twin."""
    n = num_tokens_per_bs
    real, padded = raw_bs * n, bs * n
    b, a = before.tensors(), after.tensors()
    for name in ("input_ids", "positions", "out_cache_loc", "hidden_states"):
        assert torch.equal(bits(a[name][:real]), bits(src[f"src_{name}"])), name
        assert torch.equal(bits(a[name][padded:]), bits(b[name][padded:])), name  # untouched
    assert (a["input_ids"][real:padded] == 0).all()
    assert (a["positions"][real:padded] == 0).all()
    assert (a["out_cache_loc"][real:padded] == pad_slot).all()
    assert torch.equal(bits(a["hidden_states"][real:padded]),
                       bits(torch.zeros(padded - real, after.hidden_size)))
    pads = {"seq_lens": seq_len_fill_value, "req_indices": 0, "num_correct_drafts": 0,
            "num_accept_tokens": -1, "temperatures": 1.0, "mrope_deltas": 0}
    for name, pad in pads.items():
        assert torch.equal(bits(a[name][:raw_bs]), bits(src[f"src_{name}"])), name
        assert (a[name][raw_bs:bs] == pad).all(), name
        assert torch.equal(bits(a[name][bs:]), bits(b[name][bs:])), name  # untouched
    rows = torch.arange(bs)
    expect_select = rows * n + num_front_tokens + a["num_correct_drafts"][:bs]
    assert torch.equal(a["select_index"][:bs], expect_select)
    assert torch.equal(a["select_index"][bs:], b["select_index"][bs:])
    mrope = a["mrope_positions"]
    want = a["positions"][:padded] + a["mrope_deltas"][:bs].repeat_interleave(n)
    assert torch.equal(mrope[:, :padded], want.expand(3, -1))
    assert (mrope[:, real:padded] == 0).all()  # padded rows: 0 + 0, never negative
    assert torch.equal(mrope[:, padded:], b["mrope_positions"][:, padded:])


# ------------------------------------------------------------------ hand-made example


def example_src(s: list[int], ncd: list[int], deltas: list[int], n: int = 4,
                hidden: int = 3) -> dict[str, torch.Tensor]:
    """Requests with committed lengths ``s``: positions ``S + j`` (verify / draft extend)."""
    raw_bs = len(s)
    pos = torch.tensor([si + j for si in s for j in range(n)], dtype=torch.int64)
    i64 = torch.int64
    return {
        "src_input_ids": torch.arange(raw_bs * n, dtype=i64) + 100,
        "src_positions": pos,
        "src_out_cache_loc": pos + 1000,  # a slot is not a rope position
        "src_hidden_states": torch.arange(raw_bs * n * hidden, dtype=torch.float32).view(-1, hidden)
        - 5.0,
        "src_seq_lens": torch.tensor(s, dtype=i64),
        "src_req_indices": torch.arange(raw_bs, dtype=i64) + 1,
        "src_num_correct_drafts": torch.tensor(ncd, dtype=i64),
        "src_num_accept_tokens": torch.tensor(ncd, dtype=i64) + 1,
        "src_temperatures": torch.tensor([0.5] * raw_bs, dtype=torch.float32),
        "src_mrope_deltas": torch.tensor(deltas, dtype=i64),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_made_example_and_mrope_refresh(backend: str) -> None:
    # request 0: the notes' worked example (image, delta -3, S = 10, A = 3); request 1: text
    bufs = SpecGraphBuffers.allocate(max_bs=4, num_tokens_per_bs=4, hidden_size=3)
    garbage(bufs, torch.Generator().manual_seed(1))
    kw = {"bs": 3, "num_tokens_per_bs": 4, "num_front_tokens": 0, "seq_len_fill_value": 1}
    fill(bufs, backend, example_src([10, 5], [2, 0], [-3, 0]), raw_bs=2, **kw)

    assert bufs.select_index[:3].tolist() == [2, 4, 8]  # i*N + A - 1; the pad row its first row
    assert bufs.num_accept_tokens[:3].tolist() == [3, 1, -1]
    assert bufs.seq_lens[:3].tolist() == [10, 5, 1]
    assert bufs.positions[:12].tolist() == [10, 11, 12, 13, 5, 6, 7, 8, 0, 0, 0, 0]
    row = [7, 8, 9, 10, 5, 6, 7, 8, 0, 0, 0, 0]
    assert bufs.mrope_positions[:, :12].tolist() == [row] * 3
    assert bufs.out_cache_loc[8:12].tolist() == [0] * 4
    assert bufs.temperatures[:3].tolist() == [0.5, 0.5, 1.0]

    # next round: new committed lengths, new positions -> mrope must follow (a stale copy is
    # exactly the bug this prevents); request 1 has finished, so its rows are now padding
    fill(bufs, backend, example_src([13], [1], [-3]), raw_bs=1, **kw)
    assert bufs.positions[:12].tolist() == [13, 14, 15, 16] + [0] * 8
    assert bufs.mrope_positions[:, :12].tolist() == [[10, 11, 12, 13] + [0] * 8] * 3
    assert bufs.select_index[:3].tolist() == [1, 4, 8]
    assert bufs.num_accept_tokens[:3].tolist() == [2, -1, -1]
    assert bufs.mrope_deltas[:3].tolist() == [-3, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_tree_verify_positions(backend: str) -> None:
    """A draft tree's verify (docs/architecture.md: S = 10, delta -3, nodes root, a, b, c, e
    at depths 0, 1, 1, 2, 3): positions S + depth, not monotone in the row, and mrope follows
    them row by row; the KV slots stay S + j."""
    bufs = SpecGraphBuffers.allocate(max_bs=2, num_tokens_per_bs=5, hidden_size=3)
    garbage(bufs, torch.Generator().manual_seed(2))
    src = example_src([10], [0], [-3], n=5)
    src["src_positions"] = torch.tensor([10, 11, 11, 12, 13])
    fill(bufs, backend, src, raw_bs=1, bs=2, num_tokens_per_bs=5, num_front_tokens=0,
         seq_len_fill_value=1)
    assert bufs.positions[:10].tolist() == [10, 11, 11, 12, 13] + [0] * 5
    assert bufs.mrope_positions[:, :10].tolist() == [[7, 8, 8, 9, 10] + [0] * 5] * 3
    assert bufs.out_cache_loc[:5].tolist() == [1010, 1011, 1012, 1013, 1014]


@pytest.mark.parametrize("backend", BACKENDS)
def test_front_tokens_shift_select_index(backend: str) -> None:
    bufs = SpecGraphBuffers.allocate(max_bs=2, num_tokens_per_bs=4, hidden_size=2)
    src = example_src([7, 20], [0, 1], [0, 5], hidden=2)
    fill(bufs, backend, src, raw_bs=2, bs=2, num_tokens_per_bs=4, num_front_tokens=2,
         seq_len_fill_value=0)
    assert bufs.select_index.tolist() == [2, 7]
    assert bufs.mrope_positions[0].tolist() == [7, 8, 9, 10, 25, 26, 27, 28]


# ------------------------------------------------------------------ dispatch


def test_dispatch_picks_native_on_cpu_and_npu() -> None:
    assert select_backend("cpu") == "native"
    assert select_backend(torch.device("cpu")) == "native"
    assert select_backend("npu:0") == "native"
    if HAS_TRITON:
        assert select_backend("cuda:0") == "triton"
    bufs = SpecGraphBuffers.allocate(max_bs=2, num_tokens_per_bs=2, hidden_size=2)
    src = example_src([3], [1], [-1], n=2, hidden=2)
    used = fill_draft_extend_prepare_buffers(
        bufs, **src, raw_bs=1, bs=2, num_tokens_per_bs=2, num_front_tokens=0, seq_len_fill_value=1
    )
    assert used == "native"
    assert bufs.mrope_positions[:, :4].tolist() == [[2, 3, 0, 0]] * 3


@needs_triton
def test_dispatch_backend_override() -> None:
    bufs = SpecGraphBuffers.allocate(max_bs=2, num_tokens_per_bs=2, hidden_size=2)
    ref = clone(bufs)
    src = example_src([3], [1], [-1], n=2, hidden=2)
    kw = {"raw_bs": 1, "bs": 2, "num_tokens_per_bs": 2, "num_front_tokens": 0,
          "seq_len_fill_value": 1}
    with interpret(True):
        assert fill_draft_extend_prepare_buffers(bufs, **src, **kw, backend="triton") == "triton"
    fill_draft_extend_prepare_buffers_native(ref, **src, **kw)
    assert_bit_identical(bufs, ref)
    with interpret(False), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fill_draft_extend_prepare_buffers(bufs, **src, **kw, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        fill_draft_extend_prepare_buffers(bufs, **src, **kw, backend="cuda")  # type: ignore[arg-type]


# ------------------------------------------------------------------ buffers and bad arguments


def test_allocate_and_padded_size() -> None:
    bufs = SpecGraphBuffers.allocate(max_bs=8, num_tokens_per_bs=4, hidden_size=16)
    assert bufs.input_ids.shape == (32,) and bufs.input_ids.dtype == torch.int64
    assert bufs.mrope_positions.shape == (3, 32)
    assert bufs.hidden_states.shape == (32, 16) and bufs.hidden_states.dtype == torch.float32
    assert bufs.temperatures.dtype == torch.float32 and bufs.select_index.shape == (8,)
    assert all(t.is_contiguous() for t in bufs.tensors().values())
    sizes = [1, 2, 4, 8, 16]
    assert [bufs.padded_size(b, sizes) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bufs.padded_size(3, [8, 4]) == 4  # order of capture sizes does not matter
    with pytest.raises(ValueError, match="no captured batch size"):
        bufs.padded_size(9, sizes)  # 16 exceeds max_bs: not a usable size
    with pytest.raises(ValueError, match=">= 1"):
        bufs.padded_size(0, sizes)
    with pytest.raises(ValueError):
        SpecGraphBuffers.allocate(max_bs=0, num_tokens_per_bs=4, hidden_size=16)


def _bad_cases() -> list[tuple[str, dict[str, Any], str]]:
    i32 = torch.int32
    return [
        ("raw_bs > bs", {"raw_bs": 3, "bs": 2}, "raw_bs <= bs"),
        ("bs > max_bs", {"bs": 5}, "max_bs"),
        ("bs = 0", {"raw_bs": 0, "bs": 0}, "bs >= 1"),
        ("N mismatch", {"num_tokens_per_bs": 3}, "num_tokens_per_bs"),
        ("front too large", {"num_front_tokens": 4}, "num_front_tokens"),
        ("short ids", {"src_input_ids": torch.zeros(7, dtype=torch.int64)}, "src_input_ids"),
        ("int32 positions", {"src_positions": torch.zeros(8, dtype=i32)}, "src_positions"),
        ("hidden width", {"src_hidden_states": torch.zeros(8, 2)}, "src_hidden_states"),
        ("float64 temps", {"src_temperatures": torch.ones(2, dtype=torch.float64)}, "temperat"),
        ("deltas length", {"src_mrope_deltas": torch.zeros(3, dtype=torch.int64)}, "deltas"),
        ("ncd dtype", {"src_num_correct_drafts": torch.zeros(2, dtype=i32)}, "correct"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_arguments_raise(backend: str, case: tuple[str, dict[str, Any], str]) -> None:
    _, override, match = case
    bufs = SpecGraphBuffers.allocate(max_bs=4, num_tokens_per_bs=4, hidden_size=3)
    before = clone(bufs)
    args: dict[str, Any] = dict(example_src([10, 5], [2, 0], [-3, 0]), raw_bs=2, bs=3,
                                num_tokens_per_bs=4, num_front_tokens=0, seq_len_fill_value=1)
    args.update(override)
    src = {k: v for k, v in args.items() if k.startswith("src_")}
    kw = {k: v for k, v in args.items() if not k.startswith("src_")}
    with pytest.raises(ValueError, match=match):
        fill(bufs, backend, src, **kw)
    assert_bit_identical(bufs, before)  # checked before any write
