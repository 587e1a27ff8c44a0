"""Turning a user's prompt (token ids, images and videos) into what the model runner consumes.

:class:`RequestState` is the engine's per-request payload (``Request.payload``): the visual
inputs' patches and grids (images and videos together, in prompt order), the prompt's 3-D rope
table and mrope delta, the vision embeddings while the prompt is being prefilled, and the
request's random generator.

Devices: patches and the rope table stay on the host (the model copies patches to its device when
it encodes them; rope table columns are copied into each forward's positions); the vision
embeddings and the generator live on the engine's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.multimodal.mrope import Grid, VisionBlock, num_image_tokens, vision_blocks
from engine.multimodal.prompt_layout import frame_blocks, prompt_rope_index


@dataclass(frozen=True)
class ImageInput:
    """One image as the vision tower takes it: patches ``[t*h*w, C*T*P*P]`` and its grid."""

    patches: torch.Tensor
    grid_thw: Grid


def image_from_array(patches: np.ndarray, grid_thw: Grid) -> ImageInput:
    """An :class:`ImageInput` owning a float32 copy of ``patches``."""
    return ImageInput(torch.from_numpy(np.array(patches, dtype=np.float32)), grid_thw)


@dataclass(frozen=True)
class VideoInput:
    """One video as the vision tower takes it: patches ``[t*h*w, C*T*P*P]`` of its frames (``t``
    temporal patches of ``temporal_patch_size`` frames each) and its grid; ``second_per_grid`` is
    the seconds one temporal patch spans (Qwen2.5-VL spaces temporal positions by it);
    ``timestamps``: Qwen3-VL's seconds of each temporal patch, shown in the prompt (empty:
    derived from ``second_per_grid``, see ``video_timestamps.default_timestamps``)."""

    patches: torch.Tensor
    grid_thw: Grid
    second_per_grid: float = 1.0
    timestamps: tuple[float, ...] = ()


def video_from_array(
    patches: np.ndarray, grid_thw: Grid, second_per_grid: float = 1.0
) -> VideoInput:
    """A :class:`VideoInput` owning a float32 copy of ``patches``."""
    return VideoInput(torch.from_numpy(np.array(patches, dtype=np.float32)), grid_thw,
                      float(second_per_grid))


@dataclass(eq=False)
class RequestState:
    """Engine-side data of one request (the scheduler never reads it)."""

    images: list[ImageInput | VideoInput]  # visual inputs in prompt order; emptied after prefill
    mrope_table: torch.Tensor | None  # [3, L] prompt positions; None for text-only prompts
    delta: int  # mrope delta: tokens past the prompt sit at n + delta
    image_prefix: np.ndarray | None  # [L + 1] vision (image and video) tokens in prompt[:i]
    # prompt tokens from here on are resumed output (SamplingParams.resumed_tokens): text, even
    # where an id is a vision placeholder's
    vision_end: int = 1 << 62
    generator: torch.Generator | None = None
    # the vision tower's output for every vision token, in prompt order (engine.models
    # .step_extras.VisualEmbeds; typed loosely: this module does not import the models)
    image_embeds: Any = field(default=None, repr=False)
    # first placeholder index of each visual input, in prompt order (``images``' order)
    vision_starts: tuple[int, ...] = ()


def build_state(
    token_ids: Sequence[int],
    images: Sequence[ImageInput],
    cfg: ModelConfig,
    videos: Sequence[VideoInput] = (),
    resumed: int = 0,
) -> RequestState:
    """Validate a prompt against ``cfg`` and precompute its rope table.

    Raises :class:`InvalidRequestError` for an empty prompt, ids outside the vocabulary, images
    or videos with bad grids or patches, or image (video) tokens that do not match the images'
    (videos') grids. The state's visual inputs are in prompt order, the order the vision tower
    encodes them in and their tokens take their embeddings in.

    ``resumed`` (``SamplingParams.resumed_tokens``): the last ``resumed`` tokens are output of an
    earlier run of the request. They are text whatever their ids (a model may emit a vision
    placeholder id), at positions ``n + delta`` as decoding gave them, so the state equals the
    one decoding had reached.
    """
    if len(token_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    if not 0 <= resumed < len(token_ids):
        raise InvalidRequestError(f"resumed_tokens {resumed} must be less than the prompt's "
                                  f"{len(token_ids)} tokens")
    ids = np.asarray(token_ids, dtype=np.int64)
    vocab = cfg.text.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {vocab})")
    state = _prompt_state(ids[:len(ids) - resumed], images, cfg, videos)
    if resumed and state.mrope_table is not None:
        start = len(ids) - resumed
        tail = torch.arange(start, len(ids), dtype=state.mrope_table.dtype) + state.delta
        state.mrope_table = torch.cat([state.mrope_table, tail.expand(3, -1)], dim=1)
        assert state.image_prefix is not None
        state.image_prefix = np.concatenate(
            (state.image_prefix, np.full(resumed, state.image_prefix[-1])))
        state.vision_end = start
    return state


def _prompt_state(ids: np.ndarray, images: Sequence[ImageInput], cfg: ModelConfig,
                  videos: Sequence[VideoInput]) -> RequestState:
    """:func:`build_state` of a prompt without resumed tokens (ids already checked)."""
    merge = cfg.vision.spatial_merge_size
    for i, image in enumerate(images):
        _check_visual("image", i, image, cfg)
    for i, video in enumerate(videos):
        _check_visual("video", i, video, cfg)
        _check_seconds(i, video.second_per_grid)
    vision = (ids == cfg.image_token_id) | (ids == cfg.video_token_id)
    if not images and not videos and not vision.any():
        return RequestState(images=[], mrope_table=None, delta=0, image_prefix=None)
    image_grids = [im.grid_thw for im in images]
    whole = [v.grid_thw for v in videos]
    table, delta = prompt_rope_index(ids.tolist(), cfg, image_grids, whole,
                                     [v.second_per_grid for v in videos])
    video_grids, frame_of = frame_blocks(cfg, whole)  # Qwen3: the video of each frame block
    blocks = vision_blocks(ids.tolist(), image_grids, cfg.image_token_id, merge,
                           video_grids=video_grids, video_token_id=cfg.video_token_id)
    if frame_of:
        blocks = _whole_videos(blocks, frame_of)
    ordered = [images[b.index] if b.kind == "image" else videos[b.index] for b in blocks]
    prefix = np.concatenate(([0], np.cumsum(vision)))
    return RequestState(images=ordered, mrope_table=torch.from_numpy(table), delta=delta,
                        image_prefix=prefix, vision_starts=tuple(b.start for b in blocks))


def _whole_videos(blocks: list[VisionBlock], frame_of: list[int]) -> list[VisionBlock]:
    """Qwen3's frame blocks merged back into one block per video (at its first frame): the
    vision tower encodes a video whole, so its frames must follow each other with no other
    visual input between them (text, the timestamps, may sit between)."""
    out: list[VisionBlock] = []
    for b in blocks:
        if b.kind != "video":
            out.append(b)
            continue
        video = frame_of[b.index]
        if b.index == 0 or frame_of[b.index - 1] != video:  # the video's first frame
            out.append(VisionBlock("video", video, b.start, b.count))
            continue
        last = out[-1]
        if last.kind != "video" or last.index != video:
            raise InvalidRequestError(f"video {video}: another image or video sits between "
                                      "its frames")
        out[-1] = VisionBlock("video", video, last.start, last.count + b.count)
    return out


def _check_visual(kind: str, i: int, item: ImageInput | VideoInput, cfg: ModelConfig) -> None:
    v = cfg.vision
    t, h, w = item.grid_thw
    m = v.spatial_merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise InvalidRequestError(
            f"{kind} {i}: grid {item.grid_thw} must be positive with h and w multiples of {m}"
        )
    shape = (t * h * w, v.patch_dim)
    if tuple(item.patches.shape) != shape:
        raise InvalidRequestError(
            f"{kind} {i}: patches have shape {tuple(item.patches.shape)}, grid {item.grid_thw} "
            f"needs {shape}"
        )
    if num_image_tokens(item.grid_thw, m) == 0:
        raise InvalidRequestError(f"{kind} {i}: grid {item.grid_thw} has no tokens")


def _check_seconds(i: int, seconds: float) -> None:
    try:
        ok = math.isfinite(seconds) and seconds > 0
    except TypeError:
        ok = False
    if not ok:
        raise InvalidRequestError(
            f"video {i}: second_per_grid must be a positive finite number, got {seconds!r}"
        )
