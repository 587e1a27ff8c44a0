"""Launch configurations of the paged-attention kernels: the one table the launcher in
:mod:`engine.attention.kernels.paged_attention` picks from and the GPU-readiness suite
(``tests/gpu_readiness``) compiles, entry by entry, for ``cuda:90`` and ``cuda:80``.

Pure Python (no ``triton``, no ``torch``), so the suite can import it in a process whose kernels
run in the interpreter. A tile is chosen per (dtype, padded head dim): the per-thread register
file holds the float32 accumulator (``rows x D_PAD``), the scores (``rows x BLOCK_N``) and the
64-bit pointers of the gathered K/V tiles (``D_PAD x BLOCK_N``), so float32 operands and the
widest heads get the smallest tiles. Each entry was picked as the largest tile that compiles
without a register spill on sm_90 and sm_80, tree mask included (the suite checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_DOT = 16  # smallest tile side tl.dot accepts
HEAD_DIM_PADS = (16, 32, 64, 128, 256)  # the padded head dims the table covers
MAX_GROUP = 16  # the widest query-head group per kv head the table is checked for
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Tile:
    """An attention tile: ``rows`` query rows (tokens x group heads) per extend program,
    ``block_n`` keys per inner step, and the launch's warps and pipeline stages."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int = 3


# Before this table every dtype and head dim took Tile(64, 64, 4): the float32 tree kernel
# spilled ~35 KB (sm_90) and the 16-bit tree kernel 0.8-19 KB, depending on the head dim.
_F16 = {16: Tile(64, 32, 8), 32: Tile(64, 32, 8), 64: Tile(64, 32, 8), 128: Tile(64, 32, 8),
        256: Tile(32, 16, 8)}
_F32 = {16: Tile(32, 32, 8), 32: Tile(32, 32, 8), 64: Tile(32, 32, 8), 128: Tile(32, 32, 8),
        256: Tile(16, 16, 8, num_stages=2)}
EXTEND_TILES: dict[tuple[str, int], Tile] = {
    **{("bfloat16", d): t for d, t in _F16.items()},
    **{("float16", d): t for d, t in _F16.items()},
    **{("float32", d): t for d, t in _F32.items()},
}
# decode: one program per (sequence, kv head, split) holds max(16, group) rows; before this
# table every entry was Tile(16, 64, 4), which spilled 0.1-0.9 KB for 16-bit and float32 keys
DECODE_TILES: dict[tuple[str, int], Tile] = {
    **{(dt, d): Tile(MIN_DOT, 32, 4) for dt in ("bfloat16", "float16") for d in HEAD_DIM_PADS},
    **{("float32", d): Tile(MIN_DOT, 16, 4) for d in HEAD_DIM_PADS},
}


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pad_dim(d: int) -> int:
    """``D`` padded to a power of two >= ``MIN_DOT``."""
    return max(MIN_DOT, next_power_of_2(d))


def _tile(table: dict[tuple[str, int], Tile], dtype: str, dim: int) -> Tile:
    d_pad = pad_dim(dim)
    # a head dim past the table takes the widest entry (not checked by the readiness suite)
    return table.get((dtype, d_pad)) or table[(dtype, max(HEAD_DIM_PADS))]


@dataclass(frozen=True)
class ExtendLaunch:
    """What :func:`extend_launch` picks for the extend kernel."""

    block_q: int
    group_pad: int
    d_pad: int
    block_n: int
    num_warps: int
    num_stages: int


def extend_launch(dtype: str, dim: int, group: int, max_q: int) -> ExtendLaunch:
    """Queries per extend program: the tile's ``rows`` of (query, head), no more queries than
    ``max_q`` needs, and at least the ``MIN_DOT`` rows a tile must have. A program of fewer
    rows than its tile's (short verify windows, small chunks) steps over ``MIN_DOT`` keys at a
    time: with the same warps, the wider step spilled a few bytes there (8-32 B, 16-bit
    operands, sm_90 and sm_80)."""
    tile = _tile(EXTEND_TILES, dtype, dim)
    group_pad = next_power_of_2(group)
    block = min(next_power_of_2(max_q), max(1, tile.rows // group_pad))
    block_q = max(block, MIN_DOT // group_pad, 1)
    block_n = tile.block_n if block_q * group_pad >= tile.rows else MIN_DOT
    return ExtendLaunch(block_q, group_pad, pad_dim(dim), block_n, tile.num_warps,
                        tile.num_stages)


@dataclass(frozen=True)
class DecodeLaunch:
    """What :func:`decode_launch` picks for the decode kernel."""

    group_pad: int
    d_pad: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_launch(dtype: str, dim: int, group: int) -> DecodeLaunch:
    tile = _tile(DECODE_TILES, dtype, dim)
    return DecodeLaunch(max(tile.rows, next_power_of_2(group)), pad_dim(dim), tile.block_n,
                        tile.num_warps, tile.num_stages)


_TARGET_PROGRAMS = 128  # decode programs (sequence x kv head x split) worth filling a GPU


def decode_splits(num_seqs: int, kv_heads: int, max_splits: int) -> int:
    """Key-range splits of a decode launch: enough programs to fill the device, at most
    ``max_splits``; a function of the launch shape only, never of the sequence lengths."""
    return max(1, min(max_splits, _TARGET_PROGRAMS // max(1, num_seqs * kv_heads)))


# -- decode_node/spec/fill_triton.py: the speculative decoder's static-buffer fill ---------------
FILL_ELEMENTS = 4096  # hidden-state elements (BLOCK_N x BLOCK_H) copied per inner step
FILL_WARPS = 8  # 4 warps spilled the 16 x 256 tile of N=16 (40 B on sm_90)


def fill_tile(num_tokens_per_bs: int, hidden_size: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_H, num_warps)`` of a buffer-fill launch."""
    block_n = next_power_of_2(num_tokens_per_bs)
    block_h = min(next_power_of_2(hidden_size), max(16, FILL_ELEMENTS // block_n))
    return block_n, block_h, FILL_WARPS
