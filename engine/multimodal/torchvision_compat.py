"""The arithmetic of transformers' torchvision backend on the CPU, in numpy (no torch import).

transformers' video processors (Qwen2-VL's and Qwen3-VL's alike) only have a torchvision backend.
On the CPU it resizes an 8-bit frame with torch's native uint8 antialiased bicubic kernel and then
normalizes in float32 with the rescale factor folded into mean and std. Both differ in the last
bit from the Pillow path of :mod:`engine.multimodal.image_processor` (Pillow's bicubic rounds its
weights at another precision: between 0.1% and 1% of the resized values are one level off), so
the Qwen3-VL video processor uses this module to match transformers exactly.

Resize, for each axis (width first, then height, each only when its size changes, with an 8-bit
intermediate): Pillow's filter support and centering, Keys cubic weights (``a = -0.5``)
normalized in float64, then rounded half away from zero to integers at the largest precision
``p <= 22`` under which the axis's largest weight still fits 15 bits; each output value is the
integer dot product plus ``2**(p - 1)``, shifted right by ``p`` and clamped to ``[0, 255]``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from engine.multimodal.image_processor import ImageProcessorConfig

_CUBIC_A = -0.5
_MAX_PRECISION = 22
_WEIGHT_LIMIT = 1 << 15


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel with ``a = -0.5``, in torch's operation order."""
    a = _CUBIC_A
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@lru_cache(maxsize=64)
def _axis_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(index [out, taps], int32 weights [out, taps], precision)`` for one axis.

    Unused taps have weight 0 and a clamped, in-range index.
    """
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    first = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C casts truncate
    last = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    count = np.clip(last - first, 0, taps)
    k = np.arange(taps)
    weights = _cubic((k[None, :] + first[:, None] - center[:, None] + 0.5) * invscale)
    weights = np.where(k[None, :] < count[:, None], weights, 0.0)
    total = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    largest = float(weights.max())
    precision = 0
    while (precision < _MAX_PRECISION
           and int(0.5 + largest * (1 << (precision + 1))) < _WEIGHT_LIMIT):
        precision += 1
    scaled = weights * (1 << precision)
    rounded = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    index = np.minimum(first[:, None] + k[None, :], in_size - 1)
    index.setflags(write=False)
    rounded.setflags(write=False)
    return index, rounded, precision


def _resize_rows(rows: np.ndarray, out_size: int) -> np.ndarray:
    """Resize axis 0 of a ``[N, M]`` uint8 array to ``out_size`` (one pass, 8-bit result)."""
    index, weights, precision = _axis_taps(rows.shape[0], out_size)
    acc = np.full((out_size, rows.shape[1]), 1 << (precision - 1), dtype=np.int32)
    term = np.empty_like(acc)
    for k in range(index.shape[1]):
        column = weights[:, k]
        if column.any():
            np.multiply(np.take(rows, index[:, k], axis=0), column[:, None], out=term)
            acc += term
    np.right_shift(acc, precision, out=acc)
    return np.clip(acc, 0, 255).astype(np.uint8)


def resize_bicubic(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[H, W, C]`` uint8 resized to ``[height, width, C]`` exactly as torch's CPU
    ``interpolate(mode="bicubic", antialias=True)`` resizes a uint8 image (what
    ``torchvision.transforms.v2.functional.resize`` runs for transformers)."""
    in_h, in_w, chans = pixels.shape
    out = pixels
    if in_w != width:
        columns = np.ascontiguousarray(out.transpose(1, 0, 2)).reshape(in_w, in_h * chans)
        out = _resize_rows(columns, width).reshape(width, in_h, chans).transpose(1, 0, 2)
    if in_h != height:
        rows = np.ascontiguousarray(out).reshape(in_h, width * chans)
        out = _resize_rows(rows, height).reshape(height, width, chans)
    return np.ascontiguousarray(out)


@lru_cache(maxsize=16)
def normalize_lut(cfg: ImageProcessorConfig) -> np.ndarray:
    """``[C, 256]`` float32: each 8-bit level after torchvision-backend rescale and normalize.

    Rescale plus normalize is fused the way transformers fuses it: float32 ``mean / r`` and
    ``std / r`` (``r = rescale_factor``, both products rounded to float32), then float32
    ``(x - mean') / std'``. Rescale alone is float32 ``x * r``.
    """
    levels = np.broadcast_to(np.arange(256, dtype=np.float32), (len(cfg.image_mean), 256))
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
    if cfg.do_rescale and cfg.do_normalize:
        inverse = np.float32(1.0 / cfg.rescale_factor)
        lut = (levels - mean * inverse) / (std * inverse)
    elif cfg.do_normalize:
        lut = (levels - mean) / std
    elif cfg.do_rescale:
        lut = levels * np.float32(cfg.rescale_factor)
    else:
        lut = levels
    lut = np.ascontiguousarray(lut, dtype=np.float32)
    lut.setflags(write=False)
    return lut
