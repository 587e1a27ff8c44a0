"""A prompt's visual layout, shared by the engine and the router so both build the same tokens:
the processors' settings for a checkpoint, placeholder expansion, and the rope check.

- :func:`processor_configs`: the image and video processor settings of a checkpoint; without a
  ``preprocessor_config.json`` (a checkpoint transformers' model wrote alone) the patch geometry
  is the vision tower's, and the video processor's family follows the model type.
- :func:`expand_prompt`: text ids with each image placeholder (``<|image_pad|>``) replaced by
  that image's tokens and each video placeholder by that video's: one run of pads (Qwen2-VL,
  Qwen2.5-VL), or one block per temporal patch after its timestamp (Qwen3-VL, Qwen3.5,
  :mod:`engine.multimodal.video_timestamps`). Without image (video) placeholders, one
  ``<|vision_start|><pad><|vision_end|>`` block per image (video) goes first, images first.
- :func:`prompt_rope_index`: the prompt's mrope table and delta by the family's rope index
  (Qwen3: a video's frames are blocks of their own); raises ``InvalidRequestError`` when the
  visual tokens do not match the grids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from engine.config import ModelConfig
from engine.multimodal.image_processor import (
    PREPROCESSOR_FILE,
    ImageProcessorConfig,
    expand_image_placeholders,
    expand_video_placeholders,
)
from engine.multimodal.mrope import Grid, num_image_tokens, rope_index
from engine.multimodal.video_processor import QWEN3_VL, VideoProcessorConfig
from engine.multimodal.video_timestamps import expand_video_frames


def processor_configs(model_dir: str | Path, cfg: ModelConfig
                      ) -> tuple[ImageProcessorConfig, VideoProcessorConfig]:
    """The checkpoint's image and video processor settings (see the module docstring)."""
    video = VideoProcessorConfig.from_dir(model_dir, family=QWEN3_VL if cfg.is_qwen3 else None)
    if (Path(model_dir) / PREPROCESSOR_FILE).is_file():
        return ImageProcessorConfig.from_dir(model_dir), video
    v = cfg.vision
    image = ImageProcessorConfig.from_dir(model_dir, patch_size=v.patch_size,
                                          temporal_patch_size=v.temporal_patch_size,
                                          merge_size=v.spatial_merge_size)
    frame = replace(video.frame, patch_size=v.patch_size,
                    temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size)
    return image, replace(video, frame=frame)


def expand_prompt(
    ids: Sequence[int], cfg: ModelConfig, image_grids: Sequence[Grid],
    video_grids: Sequence[Grid], video_timestamps: Sequence[Sequence[float]],
    encode: Callable[[str], list[int]] | None,
) -> list[int]:
    """``ids`` (a text's tokens) with its visual placeholders expanded (see the module
    docstring); ``video_timestamps``: each video's seconds per temporal patch (Qwen3 only);
    ``encode`` tokenizes the timestamps (Qwen3 videos need it)."""
    out = list(ids)
    head: list[int] = []
    for grids, pad in ((image_grids, cfg.image_token_id), (video_grids, cfg.video_token_id)):
        if grids and pad not in out:
            head += [cfg.vision_start_token_id, pad, cfg.vision_end_token_id] * len(grids)
    merge = cfg.vision.spatial_merge_size
    out = expand_image_placeholders(head + out, cfg.image_token_id,
                                    [num_image_tokens(g, merge) for g in image_grids])
    return expand_videos(out, cfg, video_grids, video_timestamps, encode)


def expand_videos(
    ids: Sequence[int], cfg: ModelConfig, video_grids: Sequence[Grid],
    video_timestamps: Sequence[Sequence[float]], encode: Callable[[str], list[int]] | None,
) -> list[int]:
    """``ids`` with one video placeholder per video expanded (:func:`expand_prompt`'s video
    half; raises ``InvalidRequestError`` on a placeholder count that is not the video count)."""
    merge = cfg.vision.spatial_merge_size
    if not cfg.is_qwen3:
        return expand_video_placeholders(list(ids), cfg.video_token_id,
                                         [num_image_tokens(g, merge) for g in video_grids])
    if not video_grids:
        return list(ids)
    if encode is None:
        raise ValueError("Qwen3 videos need a tokenizer for their timestamps")
    return expand_video_frames(
        ids, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
        [num_image_tokens((1, g[1], g[2]), merge) for g in video_grids], video_timestamps,
        encode)


def frame_blocks(cfg: ModelConfig, video_grids: Sequence[Grid]) -> tuple[list[Grid], list[int]]:
    """The grids of the prompt's video blocks and (Qwen3) the video of each: a Qwen3 video's
    temporal patches are blocks of their own (``(1, h, w)`` each); a Qwen2-family video is one
    block (its grid, and no video list)."""
    if not cfg.is_qwen3:
        return list(video_grids), []
    frame_of = [i for i, g in enumerate(video_grids) for _ in range(g[0])]
    return [(1, video_grids[i][1], video_grids[i][2]) for i in frame_of], frame_of


def prompt_rope_index(
    ids: Sequence[int], cfg: ModelConfig, image_grids: Sequence[Grid],
    video_grids: Sequence[Grid], video_seconds: Sequence[float],
) -> tuple[np.ndarray, int]:
    """The prompt's mrope table ``[3, len(ids)]`` and its delta by the family's rope index
    (videos by their :func:`frame_blocks`; Qwen3 positions frames by their timestamps' text,
    not by ``video_seconds``)."""
    blocks, _ = frame_blocks(cfg, video_grids)
    return rope_index(
        list(ids), list(image_grids), cfg.image_token_id, cfg.vision.spatial_merge_size,
        video_grids=blocks, video_token_id=cfg.video_token_id,
        video_seconds=[] if cfg.is_qwen3 else list(video_seconds),
        tokens_per_second=None if cfg.is_qwen3 else cfg.vision.tokens_per_second,
    )
