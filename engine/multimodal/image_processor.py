"""Qwen2-VL image preprocessing: decode, resize, normalize and patchify, without transformers.

One image becomes ``grid_thw = (1, gh, gw)`` patches of ``C * T * P * P`` floats, where
``P = patch_size``, ``T = temporal_patch_size`` (the single frame is repeated T times) and
``gh, gw`` are the image's height and width in patches, both multiples of ``merge_size``. Patches
are ordered the way the Qwen2-VL vision tower expects: by ``merge_size x merge_size`` block
(row-major over blocks), then row-major inside each block; inside one patch the values are ordered
``(C, T, P, P)``. The vision tower later merges each block into one LLM token, so an image costs
``num_image_tokens(grid_thw, merge_size) = t * gh * gw // merge_size**2`` tokens.

The numbers match transformers' PIL-based ``Qwen2VLImageProcessorPil``: Pillow bicubic resize of
the 8-bit RGB image, then ``float32(float64(x) * rescale_factor)``, then
``(x - mean) / std`` in float32. Because the input is 8-bit, rescale plus normalize is a
per-channel 256-entry lookup table, computed once per config.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.errors import ConfigError, InvalidRequestError
from engine.multimodal.mrope import num_image_tokens  # noqa: F401 - re-exported for callers

PREPROCESSOR_FILE = "preprocessor_config.json"
OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
ALLOWED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_NUM_CHANNELS = 3


@dataclass(frozen=True)
class ImageProcessorConfig:
    """How images are turned into vision patches (Qwen2-VL defaults).

    ``min_pixels``/``max_pixels`` bound the resized image's area; ``max_image_bytes`` and
    ``max_source_pixels`` bound what a request may upload before any decoding work is done.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    max_image_bytes: int = 32 * 1024 * 1024
    max_source_pixels: int = 8192 * 8192

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", tuple(float(v) for v in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(v) for v in self.image_std))
        self._validate()

    def _validate(self) -> None:
        for name in (
            "min_pixels",
            "max_pixels",
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "max_image_bytes",
            "max_source_pixels",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"image processor {name} must be a positive int, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if self.max_pixels < self.factor**2:
            raise ConfigError(f"max_pixels {self.max_pixels} is below one merged block")
        if len(self.image_mean) != _NUM_CHANNELS or len(self.image_std) != _NUM_CHANNELS:
            raise ConfigError("image_mean and image_std need one value per RGB channel")
        if any(not s > 0 for s in self.image_std):
            raise ConfigError(f"image_std values must be positive, got {self.image_std}")
        if isinstance(self.rescale_factor, bool) or not isinstance(
            self.rescale_factor, (int, float)
        ):
            raise ConfigError(f"rescale_factor must be a number, got {self.rescale_factor!r}")
        if not isinstance(self.do_rescale, bool) or not isinstance(self.do_normalize, bool):
            raise ConfigError("do_rescale and do_normalize must be booleans")
        if self.resample not in {int(r) for r in Image.Resampling}:
            raise ConfigError(f"unknown resample filter {self.resample!r}")

    @property
    def factor(self) -> int:
        """Side of one merged block in pixels; resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Floats per patch: ``C * T * P * P``."""
        return _NUM_CHANNELS * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dir(cls, model_dir: str | Path, **overrides: Any) -> ImageProcessorConfig:
        """Read ``model_dir/preprocessor_config.json`` if present, else use the defaults.

        Accepts the old top-level ``min_pixels``/``max_pixels`` keys and the
        ``size: {shortest_edge, longest_edge}`` form (top-level keys win, as in transformers).
        ``overrides`` (e.g. ``max_image_bytes``) replace values from the file.
        """
        path = Path(model_dir) / PREPROCESSOR_FILE
        try:
            values = read_preprocessor_json(path) if path.is_file() else {}
            values.update(overrides)
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad image processor settings in {path}: {exc}") from exc


def read_preprocessor_json(path: Path) -> dict[str, Any]:
    """The ImageProcessorConfig fields found in a transformers ``preprocessor_config.json``."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    size = raw.get("size") or {}
    if not isinstance(size, dict):
        raise ConfigError(f"{path}: 'size' must be an object, got {size!r}")
    values: dict[str, Any] = {}
    for key, size_keys in (
        ("min_pixels", ("shortest_edge", "min_pixels")),
        ("max_pixels", ("longest_edge", "max_pixels")),
    ):
        found = [raw.get(key)] + [size.get(k) for k in size_keys]
        chosen = next((v for v in found if v is not None), None)
        if chosen is not None:
            values[key] = chosen
    known = {f.name for f in fields(ImageProcessorConfig)}
    for key in known - {"min_pixels", "max_pixels", "max_image_bytes", "max_source_pixels"}:
        if raw.get(key) is not None:
            values[key] = tuple(raw[key]) if key in ("image_mean", "image_std") else raw[key]
    return values


@lru_cache(maxsize=16)
def normalize_lut(cfg: ImageProcessorConfig) -> np.ndarray:
    """``[C, 256]`` float32: the normalized value of each 8-bit level in each channel.

    Reproduces transformers' arithmetic exactly: float64 rescale, cast to float32, then
    float32 ``(x - mean) / std``.
    """
    levels = np.arange(256, dtype=np.float64)
    if cfg.do_rescale:
        levels = levels * cfg.rescale_factor
    levels32 = np.broadcast_to(levels.astype(np.float32), (_NUM_CHANNELS, 256))
    if not cfg.do_normalize:
        lut = np.ascontiguousarray(levels32)
        lut.setflags(write=False)
        return lut
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
    lut = np.ascontiguousarray((levels32 - mean) / std, dtype=np.float32)
    lut.setflags(write=False)
    return lut


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision tower.

    ``patches``: a float32 array ``[t * h * w, C * T * P * P]``; ``grid_thw``: ``(t, h, w)`` in
    patches. The module is numpy-only, so the router processes images without torch; the engine
    wraps the array with ``torch.from_numpy``.
    """

    patches: np.ndarray
    grid_thw: tuple[int, int, int]


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, area in ``[min_pixels, max_pixels]``
    (as far as rounding allows), aspect ratio kept as closely as possible.

    Raises InvalidRequestError for non-positive sides or an aspect ratio above 200.
    """
    if height <= 0 or width <= 0:
        raise InvalidRequestError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {height}x{width}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, cfg: ImageProcessorConfig) -> Image.Image:
    """Decode PNG/JPEG/WebP/GIF/BMP bytes (first frame, EXIF orientation applied).

    Size limits are checked from the header before pixels are decoded.
    """
    if len(data) == 0:
        raise InvalidRequestError("image data is empty")
    if len(data) > cfg.max_image_bytes:
        raise InvalidRequestError(
            f"image is {len(data)} bytes, more than the limit of {cfg.max_image_bytes}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        check_source_size(img.width, img.height, cfg)
        img.load()
        return ImageOps.exif_transpose(img)
    except InvalidRequestError:
        raise
    except UnidentifiedImageError as exc:  # its message names an in-memory buffer's repr
        raise InvalidRequestError(
            f"cannot decode image: not one of the formats {', '.join(ALLOWED_FORMATS)}"
        ) from exc
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"cannot decode image: {exc}") from exc


def check_source_size(width: int, height: int, cfg: ImageProcessorConfig) -> None:
    """Refuse (InvalidRequestError) a decoded picture of a size the processor will not take."""
    if width <= 0 or height <= 0:
        raise InvalidRequestError(f"image size must be positive, got {width}x{height}")
    if width * height > cfg.max_source_pixels:
        raise InvalidRequestError(
            f"image is {width}x{height} pixels, more than the limit of {cfg.max_source_pixels}"
        )


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB version of ``img``; transparency is composited onto white (as transformers does)."""
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if not has_alpha:
        return img if img.mode == "RGB" else img.convert("RGB")
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def process_image(data: bytes | Image.Image, cfg: ImageProcessorConfig) -> ProcessedImage:
    """Turn encoded image bytes (or a Pillow image) into Qwen2-VL patches and their grid."""
    img = decode_image(data, cfg) if isinstance(data, (bytes, bytearray, memoryview)) else data
    if not isinstance(img, Image.Image):
        raise InvalidRequestError(f"expected image bytes or a PIL image, got {type(data)}")
    check_source_size(img.width, img.height, cfg)
    img = to_rgb(img)
    height, width = smart_resize(img.height, img.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    img = img.resize((width, height), resample=Image.Resampling(cfg.resample))
    pixels = np.asarray(img, dtype=np.uint8)  # [H, W, C]
    patches = _patchify(pixels, cfg)
    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    return ProcessedImage(patches=patches, grid_thw=grid)


def _patchify(pixels: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """``[H, W, C]`` uint8 -> float32 ``[gh * gw, C * T * P * P]`` in Qwen2-VL order."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, chans = pixels.shape
    bh, bw = height // (p * m), width // (p * m)
    blocks = pixels.reshape(bh, m, p, bw, m, p, chans)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # [bh, bw, mh, mw, C, ph, pw]
    channel = np.arange(chans).reshape(1, 1, 1, 1, chans, 1, 1)
    values = normalize_lut(cfg)[channel, blocks]  # gather = normalize + copy, float32
    values = np.broadcast_to(values[:, :, :, :, :, None], (*values.shape[:5], t, p, p))
    return values.reshape(bh * bw * m * m, chans * t * p * p)


def validate_patches(
    patches: np.ndarray, grid_thw: tuple[int, int, int], cfg: ImageProcessorConfig
) -> ProcessedImage:
    """Check precomputed patches against their grid and return them as a ProcessedImage.

    Requires a float32 array ``[t * h * w, C * T * P * P]``, positive ``t, h, w`` with ``h`` and
    ``w`` multiples of ``merge_size``, at most ``max_pixels`` pixels over all ``t`` frames, an
    aspect ratio of at most 200, and finite values. Raises InvalidRequestError otherwise.
    """
    t, h, w = _check_grid(grid_thw, cfg)
    if not isinstance(patches, np.ndarray):
        raise InvalidRequestError(f"patches must be an array, got {type(patches).__name__}")
    if patches.dtype != np.float32:
        raise InvalidRequestError(f"patches must be float32, got {patches.dtype}")
    expected = (t * h * w, cfg.patch_dim)
    if tuple(patches.shape) != expected:
        raise InvalidRequestError(
            f"patches shape {tuple(patches.shape)} does not match grid {grid_thw}: "
            f"expected {expected}"
        )
    if not bool(np.isfinite(patches).all()):
        raise InvalidRequestError("patches contain NaN or infinite values")
    return ProcessedImage(patches=np.ascontiguousarray(patches), grid_thw=(t, h, w))


def _check_grid(grid_thw: Any, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """Validate a ``(t, h, w)`` patch grid given by a user."""
    if not isinstance(grid_thw, (tuple, list)) or len(grid_thw) != 3:
        raise InvalidRequestError(f"grid_thw must be three ints (t, h, w), got {grid_thw!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in grid_thw):
        raise InvalidRequestError(f"grid_thw must be three ints (t, h, w), got {grid_thw!r}")
    t, h, w = grid_thw
    if min(t, h, w) <= 0:
        raise InvalidRequestError(f"grid_thw values must be positive, got {grid_thw!r}")
    if h % cfg.merge_size or w % cfg.merge_size:
        raise InvalidRequestError(
            f"grid height and width must be multiples of merge_size {cfg.merge_size}, "
            f"got {grid_thw!r}"
        )
    if max(h, w) / min(h, w) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(f"grid aspect ratio must be at most {MAX_ASPECT_RATIO}")
    if t * h * w * cfg.patch_size**2 > cfg.max_pixels:
        raise InvalidRequestError(
            f"grid {grid_thw!r} is too large: at most {cfg.max_pixels} pixels in all frames"
        )
    return t, h, w


def expand_image_placeholders(
    token_ids: list[int], image_pad_id: int, token_counts: list[int]
) -> list[int]:
    """Replace the i-th ``image_pad_id`` token with ``token_counts[i]`` copies of it.

    Raises InvalidRequestError when the prompt's placeholder count differs from the image count.
    """
    return _expand_placeholders(token_ids, image_pad_id, token_counts, "image")


def expand_video_placeholders(
    token_ids: list[int], video_pad_id: int, token_counts: list[int]
) -> list[int]:
    """Replace the i-th ``video_pad_id`` token (``<|video_pad|>``) with ``token_counts[i]``
    copies of it.

    Raises InvalidRequestError when the prompt's placeholder count differs from the video count.
    """
    return _expand_placeholders(token_ids, video_pad_id, token_counts, "video")


def _expand_placeholders(
    token_ids: list[int], pad_id: int, token_counts: list[int], kind: str
) -> list[int]:
    positions = [i for i, tok in enumerate(token_ids) if tok == pad_id]
    if len(positions) != len(token_counts):
        raise InvalidRequestError(
            f"prompt has {len(positions)} {kind} placeholders but {len(token_counts)} {kind}s"
        )
    out: list[int] = []
    prev = 0
    for pos, count in zip(positions, token_counts, strict=True):
        out.extend(token_ids[prev:pos])
        out.extend([pad_id] * count)
        prev = pos + 1
    out.extend(token_ids[prev:])
    return out
