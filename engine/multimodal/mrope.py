"""Multimodal rotary positions (mrope) of Qwen2-VL and Qwen2.5-VL.

Every token has a 3-D position (temporal, height, width). Text tokens use the same value on all
three axes. A vision block (an image or a video) of merged grid ``(t, h, w)`` that starts at text
position ``p`` gives its tokens ``(p + floor(ti * interval), p + hi, p + wi)``; ``interval`` is 1
for images and for Qwen2-VL videos, and ``tokens_per_second * second_per_grid`` for Qwen2.5-VL
videos. The text after the block continues at ``p + max(h, w)``, even when a video's temporal
positions reach past that: this is what transformers' ``get_rope_index`` does (and our oracle);
vLLM continues at the block's largest position + 1 instead. A request's *mrope delta* is
``max(prompt positions) + 1 - prompt_len``; every token after the prompt (decode, draft decode,
verify, draft extend) sits at ``n + delta`` on all three axes, where ``n`` is its absolute index.

:func:`mrope_from_1d` is the one function that turns the final 1-D position tensor of a forward
into mrope positions; its column count always equals the number of tokens in the forward. The KV
slot of a token is a separate value (``engine.kv.pool.slot_of``), never derived from positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import InvalidRequestError

if TYPE_CHECKING:  # no torch at run time: the router computes rope indexes without it
    import torch

Grid = tuple[int, int, int]


def num_image_tokens(grid_thw: Grid, merge_size: int) -> int:
    """Tokens an image (or a video) of patch grid ``(t, h, w)`` occupies in the prompt."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


@dataclass(frozen=True)
class VisionBlock:
    """One run of vision tokens in a prompt: which input it is and where it sits."""

    kind: str  # "image" or "video"
    index: int  # the input's index in its own list (images or videos)
    start: int  # first prompt index of the run
    count: int  # tokens in the run


def vision_blocks(
    token_ids: Sequence[int],
    image_grids: Sequence[Grid],
    image_token_id: int,
    merge_size: int,
    *,
    video_grids: Sequence[Grid] = (),
    video_token_id: int = -1,
) -> list[VisionBlock]:
    """The prompt's vision blocks in prompt order.

    Each run of image (video) tokens is matched to the next image (video) grid of its own list:
    input ``i`` consumes exactly ``num_image_tokens(grid)`` consecutive tokens of its kind, so two
    inputs of one kind may sit back to back. Any mismatch between the tokens and the grids is an
    :class:`InvalidRequestError` naming the kind.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    kinds = {image_token_id: ("image", image_grids), video_token_id: ("video", video_grids)}
    used = {"image": 0, "video": 0}
    at = np.flatnonzero((ids == image_token_id) | (ids == video_token_id))
    blocks: list[VisionBlock] = []
    k = 0  # index into at
    while k < at.shape[0]:
        start = int(at[k])
        tok = int(ids[start])
        kind, grids = kinds[tok]
        i = used[kind]
        if i >= len(grids):
            raise InvalidRequestError(
                f"the prompt has {kind} tokens past those of its {len(grids)} {kind}s"
            )
        count = num_image_tokens(grids[i], merge_size)
        if not (ids[start : start + count] == tok).all() or start + count > ids.shape[0]:
            raise InvalidRequestError(
                f"{kind} {i} needs {count} {kind} tokens for grid {tuple(grids[i])} at index "
                f"{start}, but the prompt has fewer"
            )
        blocks.append(VisionBlock(kind, i, start, count))
        used[kind] = i + 1
        k += count
    for kind, grids in kinds.values():
        if used[kind] != len(grids):
            raise InvalidRequestError(
                f"{len(grids)} {kind}s given but the prompt has {kind} tokens for only "
                f"{used[kind]}"
            )
    return blocks


def rope_index(
    token_ids: Sequence[int],
    image_grids: Sequence[Grid],
    image_token_id: int,
    merge_size: int,
    *,
    video_grids: Sequence[Grid] = (),
    video_token_id: int = -1,
    video_seconds: Sequence[float] = (),
    tokens_per_second: float | None = None,
) -> tuple[np.ndarray, int]:
    """The prompt's 3-D positions ``[3, L]`` (an int64 array) and its mrope delta.

    Blocks are matched as :func:`vision_blocks` says. ``video_seconds`` gives each video's
    seconds per temporal grid step (empty: 1.0 each); with ``tokens_per_second`` (Qwen2.5-VL) a
    video's temporal step is ``tokens_per_second * seconds``, computed in float32 and truncated
    after the multiply as transformers does; without it (Qwen2-VL) the step is 1.
    """
    if video_seconds and len(video_seconds) != len(video_grids):
        raise InvalidRequestError(
            f"{len(video_seconds)} seconds-per-grid values given for {len(video_grids)} videos"
        )
    blocks = vision_blocks(token_ids, image_grids, image_token_id, merge_size,
                           video_grids=video_grids, video_token_id=video_token_id)
    n = len(token_ids)
    out = np.empty((3, n), dtype=np.int64)
    cursor = 0  # next prompt index to place
    pos = 0  # next text position
    for b in blocks:
        grid = (image_grids if b.kind == "image" else video_grids)[b.index]
        t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
        out[:, cursor : b.start] = np.arange(pos, pos + b.start - cursor)
        pos += b.start - cursor
        ti, hi, wi = np.meshgrid(_temporal(b, t, video_seconds, tokens_per_second),
                                 np.arange(h), np.arange(w), indexing="ij")
        block = out[:, b.start : b.start + b.count]
        block[0], block[1], block[2] = ti.ravel() + pos, hi.ravel() + pos, wi.ravel() + pos
        pos += max(h, w)
        cursor = b.start + b.count
    out[:, cursor:] = np.arange(pos, pos + n - cursor)
    delta = int(out.max()) + 1 - n if n else 0
    return out, delta


def _temporal(
    block: VisionBlock, t: int, video_seconds: Sequence[float], tokens_per_second: float | None
) -> np.ndarray:
    """Temporal offsets ``[t]`` of a block's frames (int64)."""
    if block.kind == "image" or tokens_per_second is None:
        return np.arange(t)
    seconds = video_seconds[block.index] if video_seconds else 1.0
    interval = np.float32(tokens_per_second) * np.float32(seconds)  # float32, as transformers
    return (np.arange(t, dtype=np.float32) * interval).astype(np.int64)


def mrope_from_1d(positions: torch.Tensor, deltas: torch.Tensor | int) -> torch.Tensor:
    """mrope positions ``[3, T]`` for tokens past their prompt: ``n + delta`` on all three axes.

    ``positions`` is the forward's final 1-D position tensor ``[T]``; ``deltas`` is one delta per
    row ``[T]`` (or one int for all rows). Derive this *after* ``positions`` is final.
    """
    return (positions + deltas).expand(3, -1)  # [T] -> [3, T]: a stride-0 view
