"""Qwen3-VL's video geometry: which frames are kept and the size they are resized to.

These reproduce transformers' ``Qwen3VLVideoProcessor`` (also used by Qwen3.5):

* :func:`sample_frame_indices`: ``int(total / video_fps * fps)`` frames, at least ``min_frames``
  and at most ``max_frames`` and ``total``, spread evenly over the clip
  (``round(linspace(0, total - 1, n))``, numpy's rounding);
* :func:`frame_pixel_limit`: the pixel budget of the whole clip, optionally capped per frame
  (``cap_pixels_per_frame``);
* :func:`video_smart_resize`: like the image ``smart_resize``, but the pixel limits bound all
  frames together (the frame count rounded to the temporal patch), and a side shorter than one
  merged block is first scaled up to it.
"""

from __future__ import annotations

import math

import numpy as np

from engine.errors import InvalidRequestError
from engine.multimodal.image_processor import MAX_ASPECT_RATIO


def sample_frame_indices(
    total: int, video_fps: float, fps: float, min_frames: int, max_frames: int
) -> list[int]:
    """Indices of the frames kept from a clip of ``total`` frames shot at ``video_fps`` when
    sampling ``fps`` frames per second (``total >= 1``)."""
    count = int(total / video_fps * fps)
    count = min(max(count, min_frames), max_frames, total)
    return [int(i) for i in np.linspace(0, total - 1, count).round().astype(np.int64)]


def frame_pixel_limit(
    num_frames: int, min_pixels: int, max_pixels: int, cap: bool, factor: int, max_tokens: int
) -> int:
    """The ``max_pixels`` that :func:`video_smart_resize` gets for ``num_frames`` frames.

    Uncapped it is ``max_pixels``. Capped (``cap_pixels_per_frame``), each frame gets
    ``min(max_tokens * factor**2, max_pixels // num_frames)`` pixels, at least
    ``int(1.05 * min_pixels)``.
    """
    if not cap:
        return max_pixels
    per_frame = max(min(max_tokens * factor * factor, max_pixels // num_frames),
                    int(min_pixels * 1.05))
    return per_frame * num_frames


def video_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Target ``(height, width)`` of every frame: multiples of ``factor`` with
    ``round(num_frames / temporal_factor) * temporal_factor * height * width`` in
    ``[min_pixels, max_pixels]`` as far as rounding allows.

    Raises InvalidRequestError for fewer than ``temporal_factor`` frames, non-positive sides or
    an aspect ratio above 200 (after scaling a too-short side up to ``factor``).
    """
    if num_frames < temporal_factor:
        raise InvalidRequestError(
            f"the video needs at least {temporal_factor} frames, got {num_frames}")
    if height <= 0 or width <= 0:
        raise InvalidRequestError(f"video frame size must be positive, got {height}x{width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"video aspect ratio must be at most {MAX_ASPECT_RATIO}, got {height}x{width}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
