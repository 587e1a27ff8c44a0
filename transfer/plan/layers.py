"""Pairing source buffer entries with destination buffer entries by global layer id.

Each side describes its buffer entries by a list of global layer ids, one per entry. An id occurs
once per buffer kind (K then V), so pairing takes, for each source entry in order, the next unused
destination entry with the same id: K pairs with K and V with V even when the two sides own
different layer sets (pipeline stages) or number their local buffers differently. Draft-model
layers live in the band ``num_hidden_layers + i`` (:func:`draft_layer_ids`).

Every check runs before the caller moves a byte.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

from transfer.errors import LayerPairingError


def draft_layer_ids(num_hidden_layers: int, num_draft_layers: int) -> list[int]:
    """Global ids of a draft model's layers: the band just above the target's layers."""
    return [num_hidden_layers + i for i in range(num_draft_layers)]


def pair_entries(
    src_ids: Sequence[int] | None,
    dst_ids: Sequence[int] | None,
    num_src: int,
    num_dst: int,
) -> list[tuple[int, int]]:
    """``(src_entry, dst_entry)`` for every source entry.

    With ids on both sides, entries pair by id in order of occurrence. With ids on neither side,
    entries pair by position, allowed only when both sides have the same number of entries.
    Raises :class:`LayerPairingError` for ids on one side only, ragged id lists, a source id the
    destination lacks (or has fewer occurrences of), and unequal counts without ids.
    """
    has_src, has_dst = bool(src_ids), bool(dst_ids)
    if has_src != has_dst:
        side = "source" if has_src else "destination"
        raise LayerPairingError(
            f"layer ids were given by the {side} only; both peers must give them or neither"
        )
    if not has_src:
        if num_src != num_dst:
            raise LayerPairingError(
                f"without layer ids, entry counts must match: {num_src} source entries, "
                f"{num_dst} destination entries"
            )
        return [(i, i) for i in range(num_src)]
    assert src_ids is not None and dst_ids is not None
    if len(src_ids) != num_src or len(dst_ids) != num_dst:
        raise LayerPairingError(
            f"ragged layer ids: {len(src_ids)} ids for {num_src} source entries, "
            f"{len(dst_ids)} ids for {num_dst} destination entries"
        )
    free: dict[int, deque[int]] = defaultdict(deque)
    for j, lid in enumerate(dst_ids):
        free[lid].append(j)
    pairs = []
    for i, lid in enumerate(src_ids):
        if not free[lid]:
            raise LayerPairingError(
                f"destination lacks an entry for layer {lid} (source entry {i})"
            )
        pairs.append((i, free[lid].popleft()))
    return pairs


def check_bytes_per_page(
    pairs: Sequence[tuple[int, int]], src_bpp: Sequence[int], dst_bpp: Sequence[int]
) -> None:
    """Raise :class:`LayerPairingError` if any pair's two entries differ in bytes per page."""
    for i, j in pairs:
        if src_bpp[i] != dst_bpp[j]:
            raise LayerPairingError(
                f"bytes per page differ: source entry {i} has {src_bpp[i]}, "
                f"destination entry {j} has {dst_bpp[j]}"
            )
