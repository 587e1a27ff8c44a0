"""Multimodal rotary positions (mrope) of Qwen2-VL.

Every token has a 3-D position (temporal, height, width). Text tokens use the same value on all
three axes; the tokens of an image of merged grid ``(t, h, w)`` that starts at text position
``p`` get ``(p + ti, p + hi, p + wi)``, and the text after the image continues at
``p + max(h, w)``. A request's *mrope delta* is
``max(prompt positions) + 1 - prompt_len``; every token after the prompt (decode, draft decode,
verify, draft extend) sits at ``n + delta`` on all three axes, where ``n`` is its absolute index.

:func:`mrope_from_1d` is the one function that turns the final 1-D position tensor of a forward
into mrope positions; its column count always equals the number of tokens in the forward. The KV
slot of a token is a separate value (``engine.kv_cache.slot_of``), never derived from positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.errors import InvalidRequestError

Grid = tuple[int, int, int]


def num_image_tokens(grid_thw: Grid, merge_size: int) -> int:
    """Tokens an image of patch grid ``(t, h, w)`` occupies in the prompt."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


def rope_index(
    token_ids: Sequence[int],
    image_grids: Sequence[Grid],
    image_token_id: int,
    merge_size: int,
) -> tuple[torch.Tensor, int]:
    """The prompt's 3-D positions ``[3, L]`` (int64) and its mrope delta.

    Images are matched to runs of ``image_token_id`` in order: image ``i`` consumes exactly
    ``num_image_tokens(image_grids[i])`` consecutive image tokens. Any mismatch between the
    image tokens in the prompt and the grids is an :class:`InvalidRequestError`.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    n = ids.shape[0]
    out = np.empty((3, n), dtype=np.int64)
    image_at = np.flatnonzero(ids == image_token_id)
    cursor = 0  # next prompt index to place
    pos = 0  # next text position
    k = 0  # index into image_at
    for i, grid in enumerate(image_grids):
        count = num_image_tokens(grid, merge_size)
        t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
        if k >= image_at.shape[0]:
            raise InvalidRequestError(
                f"{len(image_grids)} images given but the prompt has image tokens for only {i}"
            )
        start = int(image_at[k])
        if start + count > n or not (ids[start : start + count] == image_token_id).all():
            raise InvalidRequestError(
                f"image {i} needs {count} image tokens for grid {tuple(grid)} at index {start}, "
                "but the prompt has fewer"
            )
        text_len = start - cursor
        out[:, cursor:start] = np.arange(pos, pos + text_len)
        pos += text_len
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        block = out[:, start : start + count]
        block[0], block[1], block[2] = ti.ravel() + pos, hi.ravel() + pos, wi.ravel() + pos
        pos += max(h, w)
        cursor = start + count
        k += count
    if k != image_at.shape[0]:
        raise InvalidRequestError(
            f"the prompt has {image_at.shape[0]} image tokens but the images need {k}"
        )
    out[:, cursor:] = np.arange(pos, pos + n - cursor)
    delta = int(out.max()) + 1 - n if n else 0
    return torch.from_numpy(out), delta


def mrope_from_1d(positions: torch.Tensor, deltas: torch.Tensor | int) -> torch.Tensor:
    """mrope positions ``[3, T]`` for tokens past their prompt: ``n + delta`` on all three axes.

    ``positions`` is the forward's final 1-D position tensor ``[T]``; ``deltas`` is one delta per
    row ``[T]`` (or one int for all rows). Derive this *after* ``positions`` is final.
    """
    return torch.add(positions, deltas).expand(3, -1)  # [T] -> [3, T]: a stride-0 view
