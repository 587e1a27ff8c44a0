"""Qwen3-VL's video prompt layout: a text timestamp before each temporal patch of a video.

Qwen3-VL (and Qwen3.5) give the LLM a video as one block per temporal patch (``T`` frames,
``T = temporal_patch_size``)::

    <{t:.1f} seconds><|vision_start|><|video_pad|> * frame_tokens<|vision_end|>

where ``t`` is the mean time of the patch's first and last frame and ``frame_tokens`` is
``h * w / merge_size**2``. Every block carries its own vision start and end, so a chat
template's ``<|vision_start|><|video_pad|><|vision_end|>`` is replaced whole and the prompt
reads ``<0.3 seconds><|vision_start|>...<|vision_end|><1.3 seconds><|vision_start|>...``, the
layout Qwen3-VL was trained on (transformers' ``Qwen3VLProcessor`` from 5.25, vLLM). A bare
``<|video_pad|>`` is replaced alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.errors import InvalidRequestError


def frame_timestamps(
    frame_indices: Sequence[int], fps: float, temporal_patch_size: int
) -> list[float]:
    """Seconds of each temporal patch: the indices (in frames of a clip shot at ``fps``) padded
    to a multiple of ``temporal_patch_size`` by repeating the last, then the mean of each
    patch's first and last frame time. One value per temporal patch of the video's grid."""
    indices = list(frame_indices)
    if not indices:
        return []
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [i / fps for i in indices]
    t = temporal_patch_size
    return [(seconds[g] + seconds[g + t - 1]) / 2 for g in range(0, len(seconds), t)]


def default_timestamps(
    grid_t: int, second_per_grid: float, temporal_patch_size: int
) -> list[float]:
    """Timestamps of a video known only by its grid: ``grid_t * T`` frames evenly spaced from
    0 s, ``T`` of them every ``second_per_grid`` seconds (what :func:`frame_timestamps` gives
    for frames that were not sampled further)."""
    fps = temporal_patch_size / second_per_grid
    return frame_timestamps(range(grid_t * temporal_patch_size), fps, temporal_patch_size)


def timestamp_text(seconds: float) -> str:
    """The text before one temporal patch, e.g. ``<1.4 seconds>`` (Python's ``.1f``)."""
    return f"<{seconds:.1f} seconds>"


def expand_video_frames(
    ids: Sequence[int],
    video_token_id: int,
    vision_start_id: int,
    vision_end_id: int,
    frame_tokens: Sequence[int],
    timestamps: Sequence[Sequence[float]],
    encode: Callable[[str], list[int]],
) -> list[int]:
    """``ids`` with the i-th ``video_token_id`` replaced by video i's Qwen3-VL blocks.

    Video i has ``len(timestamps[i])`` temporal patches of ``frame_tokens[i]`` tokens each; patch
    ``g`` becomes ``encode(timestamp_text(timestamps[i][g])) + [vision_start_id] +
    [video_token_id] * frame_tokens[i] + [vision_end_id]``. A placeholder a chat template
    wrapped (``vision_start, video, vision_end``) is replaced with its wrapper, since every
    block carries its own: the layout Qwen3-VL was trained on (and transformers >= 5.25,
    vLLM). A bare placeholder is replaced alone. ``encode`` must add no special tokens; its
    results are reused for equal texts.

    Raises InvalidRequestError when the prompt's placeholder count differs from the video count.
    """
    if len(frame_tokens) != len(timestamps):
        raise ValueError(
            f"{len(frame_tokens)} frame token counts but {len(timestamps)} timestamp lists")
    positions = [i for i, tok in enumerate(ids) if tok == video_token_id]
    if len(positions) != len(timestamps):
        raise InvalidRequestError(
            f"prompt has {len(positions)} video placeholders but {len(timestamps)} videos")
    encoded: dict[str, list[int]] = {}
    out: list[int] = []
    prev = 0
    for pos, count, seconds in zip(positions, frame_tokens, timestamps, strict=True):
        wrapped = (prev < pos and ids[pos - 1] == vision_start_id
                   and pos + 1 < len(ids) and ids[pos + 1] == vision_end_id)
        out.extend(ids[prev:pos - 1] if wrapped else ids[prev:pos])
        for t in seconds:
            text = timestamp_text(t)
            if text not in encoded:
                encoded[text] = list(encode(text))
            out.extend(encoded[text])
            out.append(vision_start_id)
            out.extend([video_token_id] * count)
            out.append(vision_end_id)
        prev = pos + 2 if wrapped else pos + 1
    out.extend(ids[prev:])
    return out
