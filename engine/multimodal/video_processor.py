"""Qwen2-VL and Qwen3-VL video preprocessing: encoded frames -> vision patches, without
transformers.

A video is a list of encoded frames (PNG/JPEG/..., one image each, all the same size, in time
order). Every frame is decoded, converted to RGB and resized to one ``(H, W)`` chosen by the image
processor's :func:`~engine.multimodal.image_processor.smart_resize` under the video pixel limits;
the frame count is padded to a multiple of ``T = temporal_patch_size`` by repeating the last frame;
values are normalized exactly as images are. The result has grid ``(frames / T, H / P, W / P)`` and
``C * T * P * P`` floats per patch, ordered like image patches (by merged block, then row-major
inside a block; ``(C, T, P, P)`` inside a patch) with the temporal step outermost. So a video of
``T`` identical frames equals the image processor's output for that frame, which Qwen2-VL tiles
over the temporal patch.

``second_per_grid`` (Qwen2.5-VL's ``second_per_grid_ts``) is the time one temporal grid step
covers: ``T / fps``, ``fps`` defaulting to the config's (2.0 unless the checkpoint says).

Pixel limits and normalization come from the checkpoint's ``video_preprocessor_config.json``, else
its ``preprocessor_config.json`` (transformers' order), with the video defaults
(``min_pixels = 128 * 28 * 28``, ``max_pixels = 768 * 28 * 28``) where the file has none.

Qwen3-VL (``family="qwen3_vl"``: Qwen3-VL and Qwen3.5, whose ``video_processor_type`` is
``Qwen3VLVideoProcessor``) reproduces that processor instead, which differs in four ways:

* frames are sampled first: ``fps`` is the rate frames are *kept* at (2.0 by default) and a
  request's fps is the rate of the frames it sends (see
  :func:`~engine.multimodal.qwen3_video.sample_frame_indices`);
* the pixel limits bound the whole clip, not one frame
  (:func:`~engine.multimodal.qwen3_video.video_smart_resize`), and a video needs at least
  ``temporal_patch_size`` kept frames;
* resizing and normalization follow transformers' torchvision backend
  (:mod:`engine.multimodal.torchvision_compat`), not Pillow;
* the result carries one timestamp per temporal patch (the prompt shows them as text:
  :mod:`engine.multimodal.video_timestamps`), and ``second_per_grid`` is ``T`` over the kept
  frames' rate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engine.errors import ConfigError, InvalidRequestError
from engine.multimodal import torchvision_compat
from engine.multimodal.image_processor import (
    PREPROCESSOR_FILE,
    ImageProcessorConfig,
    check_source_size,
    decode_image,
    normalize_lut,
    read_preprocessor_json,
    smart_resize,
    to_rgb,
    validate_patches,
)
from engine.multimodal.qwen3_video import (
    frame_pixel_limit,
    sample_frame_indices,
    video_smart_resize,
)
from engine.multimodal.video_timestamps import frame_timestamps

VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
DEFAULT_FPS = 2.0
DEFAULT_MAX_FRAMES = 768
DEFAULT_MAX_PATCH_BYTES = 256 << 20
QWEN2_VL = "qwen2_vl"
QWEN3_VL = "qwen3_vl"
FAMILIES: tuple[str, ...] = (QWEN2_VL, QWEN3_VL)
QWEN3_VL_PROCESSOR_TYPE = "Qwen3VLVideoProcessor"
# Qwen3VLVideoProcessor's own settings, for keys its checkpoint file leaves out
QWEN3_VL_FRAME_DEFAULTS: dict[str, Any] = {
    "min_pixels": 128 * 32 * 32,
    "max_pixels": 768 * 32 * 32,
    "patch_size": 16,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
}
# video_preprocessor_config.json key -> VideoProcessorConfig field, read for Qwen3-VL only
_QWEN3_VL_KEYS = {"min_frames": "min_frames", "max_frames": "max_sampled_frames",
                  "cap_pixels_per_frame": "cap_pixels_per_frame",
                  "max_video_tokens": "max_video_tokens"}

Frame = bytes | bytearray | memoryview | Image.Image


@dataclass(frozen=True)
class VideoProcessorConfig:
    """How videos become vision patches.

    ``frame``: patch geometry, normalization and per-frame limits (``min_pixels``/``max_pixels``
    bound one resized frame, for Qwen3-VL all of them together; ``max_image_bytes``/
    ``max_source_pixels`` one uploaded frame).
    ``fps``: frames per second assumed when a request gives none (Qwen3-VL: the rate frames are
    sampled at; a request without fps is taken to be at that rate). ``max_frames``: frames a
    request may send per video. ``max_patch_bytes``: float32 bytes of one video's patches,
    checked before any frame is resized. ``family``: ``"qwen2_vl"`` or ``"qwen3_vl"`` (see the
    module docstring); Qwen3-VL only: ``min_frames``/``max_sampled_frames`` bound the sampled
    frame count, ``cap_pixels_per_frame`` and ``max_video_tokens`` are the processor's per-frame
    pixel cap. A Qwen3-VL ``frame`` must use bicubic resampling.
    """

    frame: ImageProcessorConfig = field(
        default_factory=lambda: ImageProcessorConfig(
            min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS
        )
    )
    fps: float = DEFAULT_FPS
    max_frames: int = DEFAULT_MAX_FRAMES
    max_patch_bytes: int = DEFAULT_MAX_PATCH_BYTES
    family: str = QWEN2_VL
    min_frames: int = 4
    max_sampled_frames: int = DEFAULT_MAX_FRAMES
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        if not _positive_number(self.fps):
            raise ConfigError(f"video fps must be a positive number, got {self.fps!r}")
        for name in ("max_frames", "max_patch_bytes", "min_frames", "max_sampled_frames",
                     "max_video_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"video processor {name} must be a positive int, got {value!r}")
        if self.family not in FAMILIES:
            raise ConfigError(f"video processor family must be one of {FAMILIES}, got "
                              f"{self.family!r}")
        if not isinstance(self.cap_pixels_per_frame, bool):
            raise ConfigError("cap_pixels_per_frame must be a boolean")
        if self.family == QWEN3_VL and self.frame.resample != int(Image.Resampling.BICUBIC):
            raise ConfigError("the Qwen3-VL video processor resizes bicubic only, got resample "
                              f"{self.frame.resample}")

    @property
    def max_grid_t(self) -> int:
        """The largest temporal grid a video may have: ``ceil(max_frames / T)``."""
        return -(-self.max_frames // self.frame.temporal_patch_size)

    @classmethod
    def from_dir(cls, model_dir: str | Path, family: str | None = None,
                 **overrides: Any) -> VideoProcessorConfig:
        """Read the checkpoint's video settings (see the module docstring); ``overrides`` set
        other fields (``fps``, ``max_frames``, ``max_patch_bytes``, ...).

        ``family`` None: Qwen3-VL when the video file's ``video_processor_type`` says so, else
        Qwen2-VL (pass it from the model type, as transformers does, where the file names none).
        Raises ConfigError on a bad file.
        """
        root = Path(model_dir)
        path = next((p for p in (root / VIDEO_PREPROCESSOR_FILE, root / PREPROCESSOR_FILE)
                     if p.is_file()), None)
        values = read_preprocessor_json(path) if path is not None else {}
        raw: dict[str, Any] = {}
        if path is not None and path.name == VIDEO_PREPROCESSOR_FILE:
            raw = json.loads(path.read_text(encoding="utf-8"))  # a JSON object: read above
        if family is None:
            qwen3 = raw.get("video_processor_type") == QWEN3_VL_PROCESSOR_TYPE
            family = QWEN3_VL if qwen3 else QWEN2_VL
        defaults: dict[str, Any] = (
            QWEN3_VL_FRAME_DEFAULTS if family == QWEN3_VL
            else {"min_pixels": VIDEO_MIN_PIXELS, "max_pixels": VIDEO_MAX_PIXELS})
        values = {**defaults, **values}
        keys = {"fps": "fps", "max_frames": "max_frames"}
        if family == QWEN3_VL:
            keys.update(_QWEN3_VL_KEYS)
        from_file = {field_name: raw[key] for key, field_name in keys.items()
                     if raw.get(key) is not None}
        try:
            return cls(frame=ImageProcessorConfig(**values), family=family,
                       **{**from_file, **overrides})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad video processor settings in {path}: {exc}") from exc


@dataclass(frozen=True)
class ProcessedVideo:
    """One video ready for the vision tower: float32 ``patches [t * h * w, C * T * P * P]`` (an
    array: the module is numpy-only, like :mod:`engine.multimodal.image_processor`), its grid
    ``(t, h, w)`` in patches and the seconds one temporal grid step covers. ``timestamps``
    (Qwen3-VL only, else empty): seconds of each temporal patch, ``t`` of them."""

    patches: np.ndarray
    grid_thw: tuple[int, int, int]
    second_per_grid: float
    timestamps: tuple[float, ...] = ()


def second_per_grid_of(cfg: VideoProcessorConfig, fps: float | None) -> float:
    """``T / fps`` (``fps`` None or 0: the config's); raises InvalidRequestError for a bad fps."""
    return cfg.frame.temporal_patch_size / _video_fps(cfg, fps)


def _video_fps(cfg: VideoProcessorConfig, fps: float | None) -> float:
    """A request's frame rate (None or 0: the config's); InvalidRequestError when it is bad."""
    if fps is None or fps == 0:
        fps = cfg.fps
    if not _positive_number(fps):
        raise InvalidRequestError(f"video fps must be a positive finite number, got {fps!r}")
    return float(fps)


def process_video(
    frames: Sequence[Frame], cfg: VideoProcessorConfig, fps: float | None = None
) -> ProcessedVideo:
    """Turn encoded frames (or Pillow images), ``fps`` of them a second, into video patches,
    grid and ``second_per_grid`` (and, for Qwen3-VL, timestamps) of ``cfg.family``.

    Raises InvalidRequestError for no frames, more than ``max_frames``, an undecodable frame,
    frames of different sizes, a bad ``fps`` or patches over ``max_patch_bytes``; Qwen3-VL also
    for fewer than ``temporal_patch_size`` sampled frames. Qwen3-VL decodes the sampled frames
    only.
    """
    if len(frames) == 0:
        raise InvalidRequestError("the video has no frames")
    if len(frames) > cfg.max_frames:
        raise InvalidRequestError(
            f"the video has {len(frames)} frames, more than the limit of {cfg.max_frames}")
    if cfg.family == QWEN3_VL:
        return _process_qwen3(frames, cfg, _video_fps(cfg, fps))
    second_per_grid = second_per_grid_of(cfg, fps)
    fc = cfg.frame
    first = _decode(0, frames[0], fc)
    width, height = first.size
    new_h, new_w = smart_resize(height, width, fc.factor, fc.min_pixels, fc.max_pixels)
    t = fc.temporal_patch_size
    grid = (-(-len(frames) // t), new_h // fc.patch_size, new_w // fc.patch_size)
    _check_patch_bytes(grid, cfg)
    resample = Image.Resampling(fc.resample)
    pixels = []  # F x [H, W, C] uint8
    for i, frame in enumerate(frames):
        img = first if i == 0 else _decode(i, frame, fc)
        if img.size != (width, height):
            raise InvalidRequestError(
                f"video frame {i} is {img.width}x{img.height} but frame 0 is {width}x{height}: "
                "all frames must have one size")
        resized = to_rgb(img).resize((new_w, new_h), resample=resample)
        pixels.append(np.asarray(resized, dtype=np.uint8))
    pixels += [pixels[-1]] * (-len(pixels) % t)
    patches = _patchify_frames(np.stack(pixels), fc, normalize_lut(fc))
    return ProcessedVideo(patches, grid, second_per_grid)


def _process_qwen3(
    frames: Sequence[Frame], cfg: VideoProcessorConfig, video_fps: float
) -> ProcessedVideo:
    """:func:`process_video` for Qwen3-VL (``frames`` not empty, ``video_fps`` valid)."""
    fc = cfg.frame
    t = fc.temporal_patch_size
    kept = sample_frame_indices(len(frames), video_fps, cfg.fps, cfg.min_frames,
                                cfg.max_sampled_frames)
    first = _decode(kept[0], frames[kept[0]], fc)
    width, height = first.size
    max_pixels = frame_pixel_limit(len(kept), fc.min_pixels, fc.max_pixels,
                                   cfg.cap_pixels_per_frame, fc.factor, cfg.max_video_tokens)
    new_h, new_w = video_smart_resize(len(kept), height, width, t, fc.factor, fc.min_pixels,
                                      max_pixels)
    grid = (-(-len(kept) // t), new_h // fc.patch_size, new_w // fc.patch_size)
    _check_patch_bytes(grid, cfg)
    pixels = []  # F x [H, W, C] uint8
    for i in kept:
        img = first if i == kept[0] else _decode(i, frames[i], fc)
        if img.size != (width, height):
            raise InvalidRequestError(
                f"video frame {i} is {img.width}x{img.height} but frame {kept[0]} is "
                f"{width}x{height}: all frames must have one size")
        rgb = np.asarray(to_rgb(img), dtype=np.uint8)
        pixels.append(torchvision_compat.resize_bicubic(rgb, new_h, new_w))
    pixels += [pixels[-1]] * (-len(pixels) % t)
    patches = _patchify_frames(np.stack(pixels), fc, torchvision_compat.normalize_lut(fc))
    second_per_grid = t * len(frames) / (len(kept) * video_fps)
    timestamps = tuple(frame_timestamps(kept, video_fps, t))
    return ProcessedVideo(patches, grid, second_per_grid, timestamps)


def _check_patch_bytes(grid: tuple[int, int, int], cfg: VideoProcessorConfig) -> None:
    nbytes = math.prod(grid) * cfg.frame.patch_dim * 4
    if nbytes > cfg.max_patch_bytes:
        raise InvalidRequestError(
            f"the video's patches (grid {grid}) would take {nbytes} bytes, more than the limit "
            f"of {cfg.max_patch_bytes}")


def _decode(index: int, frame: Frame, cfg: ImageProcessorConfig) -> Image.Image:
    try:
        if isinstance(frame, (bytes, bytearray, memoryview)):
            return decode_image(bytes(frame), cfg)
        if isinstance(frame, Image.Image):
            check_source_size(frame.width, frame.height, cfg)
            return frame
        raise InvalidRequestError(f"expected image bytes or a PIL image, got {type(frame)}")
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"video frame {index}: {exc}") from exc


def _patchify_frames(
    pixels: np.ndarray, cfg: ImageProcessorConfig, lut: np.ndarray
) -> np.ndarray:
    """``[F, H, W, C]`` uint8 (``F`` a multiple of ``T``) -> float32
    ``[F / T * gh * gw, C * T * P * P]`` in Qwen2-VL order, each level mapped by ``lut``
    (``[C, 256]``)."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    frames, height, width, chans = pixels.shape
    gt, bh, bw = frames // t, height // (p * m), width // (p * m)
    blocks = pixels.reshape(gt, t, bh, m, p, bw, m, p, chans)
    blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [gt, bh, bw, mh, mw, C, T, ph, pw]
    channel = np.arange(chans).reshape(1, 1, 1, 1, 1, chans, 1, 1, 1)
    values = lut[channel, blocks]  # gather = normalize + copy, float32
    return values.reshape(gt * bh * bw * m * m, chans * t * p * p)


def validate_video_patches(
    patches: np.ndarray, grid_thw: Any, second_per_grid: float, cfg: VideoProcessorConfig
) -> ProcessedVideo:
    """Check precomputed video patches and return them as a ProcessedVideo.

    Like :func:`~engine.multimodal.image_processor.validate_patches`, with ``t`` up to
    :attr:`VideoProcessorConfig.max_grid_t` and ``max_pixels`` bounding each frame, patches at
    most ``max_patch_bytes``, and ``second_per_grid`` positive and finite.
    """
    if not isinstance(grid_thw, (tuple, list)) or len(grid_thw) != 3 or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in grid_thw
    ):
        raise InvalidRequestError(f"grid_thw must be three ints (t, h, w), got {grid_thw!r}")
    t = grid_thw[0]
    if not 1 <= t <= cfg.max_grid_t:
        raise InvalidRequestError(
            f"video grid t must be in [1, {cfg.max_grid_t}] ({cfg.max_frames} frames), got {t}")
    if not _positive_number(second_per_grid):
        raise InvalidRequestError(
            f"second_per_grid must be a positive finite number, got {second_per_grid!r}")
    if isinstance(patches, np.ndarray) and patches.size * 4 > cfg.max_patch_bytes:
        raise InvalidRequestError(
            f"the video's patches take {patches.size * 4} bytes, more than the limit of "
            f"{cfg.max_patch_bytes}")
    per_frame = replace(cfg.frame, max_pixels=cfg.frame.max_pixels * t)
    image = validate_patches(patches, (t, grid_thw[1], grid_thw[2]), per_frame)
    return ProcessedVideo(image.patches, image.grid_thw, float(second_per_grid))


def _positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)
