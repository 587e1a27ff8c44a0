"""Linear-attention state transfer between sides of equal or different TP size: the plan.

A hybrid model (Qwen3.5) keeps, per request and linear-attention layer, two fixed-size states in
a *state slot* (``engine.kv.state_pool``): the conv state ``[C, K - 1]`` (model dtype) and the
recurrent state ``[Hv, Dk, Dv]`` (float32). A node registers them as state entries, ordered
``[conv_0 .. conv_{L-1}, rec_0 .. rec_{L-1}]``, each with its global layer id (as KV entries
are: the first occurrence of an id is its conv state, the second its recurrent state), so state
entries pair by :func:`transfer.plan.layers.pair_entries` exactly as KV entries do: by global
layer id, across pipeline stages that each hold a band of the layers. An entry's "page" is one
slot: ``ptr + slot * bytes_per_slot``.

Under TP a rank holds an even share of the key heads and of the value heads
(``engine.parallel.shard.TextShard.linear_here``): its conv channels are its q channels, then
its k channels, then its v channels (three *segments*, each a run of channels of ``K - 1``
elements), its recurrent state its value heads (one segment of ``Dk * Dv`` float32 each). A
:class:`StateLayout` describes one side; :func:`plan_state_copy` gives what one source rank
writes into one destination rank's slot: per entry kind, ``(src_offset, dst_offset, nbytes)``
byte ranges within a slot (the overlap of the two ranks' shares of each segment). Equal layouts
give one range covering the whole slot entry. Every refusal raises
:class:`~transfer.errors.IncompatiblePeerError` naming the numbers, before a byte moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from transfer.errors import IncompatiblePeerError, LayerPairingError

CONV, RECURRENT = 0, 1  # entry kinds: a layer id's first occurrence, then its second
_RECURRENT_ELEM = 4  # float32
_FIELDS = ("key heads", "key head dim", "value heads", "value head dim", "conv kernel",
           "conv element bytes")

Span = tuple[int, int, int]  # (src_offset, dst_offset, nbytes) within one slot's entry


class LinearShape(Protocol):
    """A whole linear-attention layer's shape (``engine.config.LinearAttentionConfig``)."""

    @property
    def num_k_heads(self) -> int: ...

    @property
    def head_k_dim(self) -> int: ...

    @property
    def num_v_heads(self) -> int: ...

    @property
    def head_v_dim(self) -> int: ...

    @property
    def conv_kernel(self) -> int: ...


class ConvStates(Protocol):
    """A state pool, as far as its layout goes (``engine.kv.state_pool.StatePool``)."""

    @property
    def conv_elem_bytes(self) -> int: ...


@dataclass(frozen=True)
class StateLayout:
    """One side's state geometry: the whole layer's heads and the side's TP size (its rank
    ``r`` holds key heads ``[r * Hk/n, (r+1) * Hk/n)`` and their value heads)."""

    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int
    conv_kernel: int
    conv_elem_bytes: int  # bytes of one conv state element (the model dtype)
    tp_size: int = 1

    def __post_init__(self) -> None:
        shape = self.geometry()
        if min(shape) < 1 or self.tp_size < 1:
            raise IncompatiblePeerError(f"state layout {self.to_list()} has a value below 1")
        if self.num_k_heads % self.tp_size or self.num_v_heads % self.tp_size:
            raise IncompatiblePeerError(
                f"TP {self.tp_size} does not divide the {self.num_k_heads} key heads and "
                f"{self.num_v_heads} value heads of the linear-attention layers")

    @classmethod
    def of(cls, lin: LinearShape | None, pool: ConvStates | None, tp_size: int = 1
           ) -> StateLayout | None:
        """The layout of linear-attention layers of shape ``lin`` over ``tp_size`` ranks,
        ``pool`` (rank 0's state pool) giving the conv states' element size; None without a
        pool (a model, or a pipeline stage, without such layers)."""
        if lin is None or pool is None:
            return None
        return cls(lin.num_k_heads, lin.head_k_dim, lin.num_v_heads, lin.head_v_dim,
                   lin.conv_kernel, pool.conv_elem_bytes, tp_size)

    def geometry(self) -> tuple[int, ...]:
        """What both sides must share: every field but the TP size."""
        return (self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim,
                self.conv_kernel, self.conv_elem_bytes)

    def to_list(self) -> list[int]:
        """The wire form (``Registration.state_layout``)."""
        return [*self.geometry(), self.tp_size]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> StateLayout | None:
        """The layout of a wire form; None for an empty one (a side without states)."""
        if not values:
            return None
        if len(values) != 7:
            raise IncompatiblePeerError(f"state layout of {len(values)} numbers, not 7")
        return cls(*values)

    def segments(self, kind: int) -> list[tuple[int, int]]:
        """``(units of the whole layer, bytes per unit)`` of each segment of a ``kind`` entry,
        in slot order (a rank holds an even share of each)."""
        if kind == CONV:
            channel = (self.conv_kernel - 1) * self.conv_elem_bytes
            keys = self.num_k_heads * self.head_k_dim
            return [(keys, channel), (keys, channel), (self.num_v_heads * self.head_v_dim,
                                                       channel)]
        return [(self.num_v_heads, self.head_k_dim * self.head_v_dim * _RECURRENT_ELEM)]

    def entry_bytes(self, kind: int) -> int:
        """Bytes of one slot of a ``kind`` entry on one rank."""
        return sum(units // self.tp_size * unit for units, unit in self.segments(kind))


@dataclass(frozen=True)
class StateCopy:
    """What one source rank writes into one destination rank's slot: byte spans per entry
    kind (empty: nothing, another source rank holds that rank's heads)."""

    conv: tuple[Span, ...]
    recurrent: tuple[Span, ...]

    @property
    def empty(self) -> bool:
        return not self.conv and not self.recurrent

    def spans(self, kind: int) -> tuple[Span, ...]:
        return self.conv if kind == CONV else self.recurrent

    def to_list(self) -> list[int]:
        """The wire form (``SendOrder.state_copy``): the conv span count, then every span."""
        return [len(self.conv), *(x for s in (*self.conv, *self.recurrent) for x in s)]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> StateCopy:
        if not values or (len(values) - 1) % 3 or values[0] * 3 > len(values) - 1:
            raise IncompatiblePeerError(f"malformed state copy of {len(values)} numbers")
        spans = [(values[k], values[k + 1], values[k + 2]) for k in range(1, len(values), 3)]
        return cls(tuple(spans[: values[0]]), tuple(spans[values[0] :]))


def check_geometry(src: StateLayout, dst: StateLayout) -> None:
    """Raise :class:`IncompatiblePeerError` naming the first field the two sides differ in."""
    for name, mine, theirs in zip(_FIELDS, src.geometry(), dst.geometry(), strict=True):
        if mine != theirs:
            raise IncompatiblePeerError(
                f"linear-attention states differ in {name}: prefill has {mine}, decode has "
                f"{theirs}")


def plan_state_copy(src: StateLayout, dst: StateLayout, src_rank: int,
                    dst_rank: int) -> StateCopy:
    """What source rank ``src_rank`` writes into destination rank ``dst_rank``'s slot (see the
    module docstring); raises :class:`IncompatiblePeerError` on differing geometry or a rank
    outside its side's TP."""
    check_geometry(src, dst)
    for side, rank, tp in (("prefill", src_rank, src.tp_size), ("decode", dst_rank, dst.tp_size)):
        if not 0 <= rank < tp:
            raise IncompatiblePeerError(f"{side} rank {rank} is outside its TP {tp}")
    return StateCopy(_overlaps(src, dst, src_rank, dst_rank, CONV),
                     _overlaps(src, dst, src_rank, dst_rank, RECURRENT))


def _overlaps(src: StateLayout, dst: StateLayout, s: int, d: int, kind: int
              ) -> tuple[Span, ...]:
    spans: list[Span] = []
    src_base = dst_base = 0
    for units, unit in src.segments(kind):
        sn, dn = units // src.tp_size, units // dst.tp_size
        lo, hi = max(s * sn, d * dn), min((s + 1) * sn, (d + 1) * dn)
        if lo < hi:
            spans.append((src_base + (lo - s * sn) * unit, dst_base + (lo - d * dn) * unit,
                          (hi - lo) * unit))
        src_base += sn * unit
        dst_base += dn * unit
    return _merge(spans)


def _merge(spans: list[Span]) -> tuple[Span, ...]:
    """Adjacent spans (consecutive on both sides) as one."""
    out: list[Span] = []
    for s, d, n in spans:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            ps, pd, pn = out.pop()
            out.append((ps, pd, pn + n))
        else:
            out.append((s, d, n))
    return tuple(out)


def entry_kinds(layer_ids: Sequence[int]) -> list[int]:
    """The kind of each state entry: :data:`CONV` for an id's first occurrence, else
    :data:`RECURRENT`; raises :class:`LayerPairingError` for an id seen more than twice."""
    seen: dict[int, int] = {}
    kinds = []
    for lid in layer_ids:
        n = seen.get(lid, 0)
        if n > 1:
            raise LayerPairingError(f"state layer {lid} has more than two entries")
        seen[lid] = n + 1
        kinds.append(CONV if n == 0 else RECURRENT)
    return kinds


def state_blocks(
    pairs: Sequence[tuple[int, int]], kinds: Sequence[int], src_ptrs: Sequence[int],
    src_bytes: Sequence[int], src_slot: int, dst_ptrs: Sequence[int], dst_bytes: Sequence[int],
    dst_slot: int, copy: StateCopy | None,
) -> tuple[list[int], list[int], list[int]]:
    """Parallel lists (src addresses, dst addresses, lengths) writing slot ``src_slot`` of
    every paired source entry into slot ``dst_slot`` of its destination entry: the whole entry
    (``copy`` None; sizes must match) or ``copy``'s spans of its kind (each inside both
    entries). Raises :class:`LayerPairingError` before anything is built otherwise."""
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for i, j in pairs:
        sb, db = src_bytes[i], dst_bytes[j]
        if copy is None:
            if sb != db:
                raise LayerPairingError(
                    f"bytes per state slot differ: source entry {i} has {sb}, destination "
                    f"entry {j} has {db}")
            spans: tuple[Span, ...] = ((0, 0, sb),)
        else:
            spans = copy.spans(kinds[i])
        for so, do, n in spans:
            if so < 0 or do < 0 or so + n > sb or do + n > db:
                raise LayerPairingError(
                    f"state span ({so}, {do}, {n}) leaves entry {i} ({sb} bytes per slot) or "
                    f"destination entry {j} ({db})")
            srcs.append(src_ptrs[i] + src_slot * sb + so)
            dsts.append(dst_ptrs[j] + dst_slot * db + do)
            lens.append(n)
    return srcs, dsts, lens
