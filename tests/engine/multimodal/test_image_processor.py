"""engine.multimodal.image_processor against transformers' PIL-based Qwen2-VL image processor (the
oracle).

transformers 5 ships two Qwen2-VL image processors: ``Qwen2VLImageProcessor`` (torchvision
backend, not installable here) and ``Qwen2VLImageProcessorPil`` (Pillow + numpy), which is the one
the engine reproduces and the one used here.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from engine.errors import ConfigError, InvalidRequestError
from engine.multimodal.image_processor import (
    ImageProcessorConfig,
    ProcessedImage,
    expand_image_placeholders,
    num_image_tokens,
    process_image,
    smart_resize,
    validate_patches,
)

qwen2_vl_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
Qwen2VLImageProcessorPil = qwen2_vl_pil.Qwen2VLImageProcessorPil
hf_smart_resize = qwen2_vl_pil.smart_resize

SMALL = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}


def _image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A smooth-plus-noise test image (JPEG-friendly, yet every pixel differs)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / max(width, 1), yy * 255 / max(height, 1), (xx + yy) % 256], -1)
    noisy = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(noisy, "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        img.putalpha(alpha)
    elif mode != "RGB":
        img = img.convert(mode)
    return img


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _oracle(img: Image.Image, min_pixels: int, max_pixels: int) -> tuple[np.ndarray, list]:
    proc = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    out = proc(images=[img], return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"][0].tolist()


def _assert_matches(result: ProcessedImage, img: Image.Image, min_pixels: int, max_pixels: int):
    ref_patches, ref_grid = _oracle(img, min_pixels, max_pixels)
    assert list(result.grid_thw) == ref_grid
    assert result.patches.dtype == np.float32
    assert tuple(result.patches.shape) == ref_patches.shape
    np.testing.assert_allclose(result.patches, ref_patches, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize(
    ("height", "width", "limits"),
    [
        (64, 64, SMALL),  # square, already near a block multiple
        (100, 150, SMALL),  # landscape
        (150, 90, SMALL),  # portrait
        (7, 9, SMALL),  # tiny: upscaled to min_pixels
        (3, 120, SMALL),  # tiny and thin (aspect 40)
        (500, 333, SMALL),  # downscaled by max_pixels
        (45, 2000, SMALL),  # very wide, downscaled
        (20, 30, {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 16}),  # big min_pixels
    ],
)
def test_bytes_match_transformers(fmt: str, height: int, width: int, limits: dict) -> None:
    data = _encode(_image(height, width, seed=height * 7 + width), fmt)
    result = process_image(data, ImageProcessorConfig(**limits))
    _assert_matches(result, Image.open(io.BytesIO(data)), **limits)


def test_default_config_downscales_big_image() -> None:
    img = _image(1400, 1100, seed=3)
    cfg = ImageProcessorConfig()
    result = process_image(_encode(img, "PNG"), cfg)
    t, h, w = result.grid_thw
    assert h * w * cfg.patch_size**2 <= cfg.max_pixels
    _assert_matches(result, img, cfg.min_pixels, cfg.max_pixels)


def test_default_config_upscales_tiny_image() -> None:
    img = _image(12, 16, seed=5)
    cfg = ImageProcessorConfig()
    result = process_image(img, cfg)
    _, h, w = result.grid_thw
    assert h * w * cfg.patch_size**2 >= cfg.min_pixels
    _assert_matches(result, img, cfg.min_pixels, cfg.max_pixels)


@pytest.mark.parametrize("mode", ["RGBA", "L", "LA", "P", "CMYK", "1"])
def test_other_modes_match_transformers(mode: str) -> None:
    img = _image(60, 80, mode="RGBA" if mode in ("RGBA", "LA") else "RGB", seed=11)
    if mode not in ("RGBA", "RGB"):
        img = img.convert(mode)
    result = process_image(img, ImageProcessorConfig(**SMALL))
    _assert_matches(result, img, **SMALL)


def test_palette_png_with_transparency_matches_transformers() -> None:
    img = _image(40, 50, seed=2).convert("P")
    img.info["transparency"] = 0
    data = _encode(img, "PNG")
    decoded = Image.open(io.BytesIO(data))
    assert decoded.info.get("transparency") is not None
    _assert_matches(process_image(data, ImageProcessorConfig(**SMALL)), decoded, **SMALL)


@settings(max_examples=25, deadline=None)
@given(height=st.integers(1, 300), width=st.integers(1, 300), seed=st.integers(0, 1000))
def test_random_sizes_match_transformers(height: int, width: int, seed: int) -> None:
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(InvalidRequestError):
            process_image(_image(height, width, seed=seed), ImageProcessorConfig(**SMALL))
        return
    img = _image(height, width, seed=seed)
    _assert_matches(process_image(img, ImageProcessorConfig(**SMALL)), img, **SMALL)


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 20000),
    width=st.integers(1, 20000),
    min_pixels=st.integers(1, 28 * 28 * 64),
    extra=st.integers(0, 28 * 28 * 4096),
)
def test_smart_resize_matches_transformers(
    height: int, width: int, min_pixels: int, extra: int
) -> None:
    max_pixels = max(min_pixels, 28 * 28) + extra
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(InvalidRequestError):
            smart_resize(height, width, 28, min_pixels, max_pixels)
        return
    expected = hf_smart_resize(height, width, 28, min_pixels, max_pixels)
    assert smart_resize(height, width, 28, min_pixels, max_pixels) == tuple(expected)


def test_patch_order_is_merge_block_major() -> None:
    """Patch k of the output is the expected pixel block, checked without the oracle."""
    cfg = ImageProcessorConfig(
        min_pixels=4,
        max_pixels=10**6,
        do_normalize=False,
        do_rescale=False,
        patch_size=2,
        merge_size=2,
        temporal_patch_size=2,
    )
    # 8x8 image whose red channel encodes the pixel index; exact size, so resize is identity.
    red = np.arange(64, dtype=np.uint8).reshape(8, 8)
    pixels = np.stack([red, red + 100, red + 150], -1).astype(np.uint8)
    result = process_image(Image.fromarray(pixels, "RGB"), cfg)
    assert result.grid_thw == (1, 4, 4)
    patches = result.patches.reshape(16, 3, 2, 2, 2)  # [patch, C, T, P, P]
    # First merge block covers pixel rows 0-3, cols 0-3: patches (0,0), (0,1), (1,0), (1,1).
    expected_origins = [(0, 0), (0, 2), (2, 0), (2, 2), (0, 4), (0, 6), (2, 4), (2, 6)]
    for k, (r, c) in enumerate(expected_origins):
        block = red[r : r + 2, c : c + 2].astype(np.float32)
        assert np.array_equal(patches[k, 0, 0], block)
        assert np.array_equal(patches[k, 0, 1], block)  # the frame is repeated over time
        assert np.array_equal(patches[k, 1, 0], block + 100)


def test_num_image_tokens() -> None:
    assert num_image_tokens((1, 8, 10), 2) == 20
    assert num_image_tokens((2, 4, 4), 2) == 8
    img = _image(100, 150)
    result = process_image(img, ImageProcessorConfig(**SMALL))
    assert num_image_tokens(result.grid_thw, 2) * 4 == result.patches.shape[0]


def test_expand_image_placeholders() -> None:
    pad = 9
    assert expand_image_placeholders([1, pad, 2, pad, 3], pad, [2, 3]) == [
        1,
        pad,
        pad,
        2,
        pad,
        pad,
        pad,
        3,
    ]
    assert expand_image_placeholders([1, 2], pad, []) == [1, 2]
    assert expand_image_placeholders([pad], pad, [0]) == []
    with pytest.raises(InvalidRequestError):
        expand_image_placeholders([1, pad, pad], pad, [4])
    with pytest.raises(InvalidRequestError):
        expand_image_placeholders([1, 2], pad, [4])


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image at all",
        _encode(_image(30, 30), "PNG")[:60],  # truncated PNG
        _encode(_image(30, 30), "JPEG")[:200],  # truncated JPEG
        _encode(_image(30, 30), "TIFF"),  # format not accepted
    ],
)
def test_undecodable_bytes(data: bytes) -> None:
    with pytest.raises(InvalidRequestError, match="image") as info:
        process_image(data, ImageProcessorConfig(**SMALL))
    assert "object at 0x" not in str(info.value)  # no in-memory buffer's repr


def test_unknown_format_names_the_accepted_ones() -> None:
    with pytest.raises(InvalidRequestError,
                       match="^cannot decode image: not one of the formats PNG, JPEG, WEBP"):
        process_image(_encode(_image(30, 30), "TIFF"), ImageProcessorConfig(**SMALL))


def test_too_many_bytes() -> None:
    data = _encode(_image(64, 64), "PNG")
    with pytest.raises(InvalidRequestError, match="bytes"):
        process_image(data, ImageProcessorConfig(max_image_bytes=len(data) - 1, **SMALL))


def test_too_many_source_pixels() -> None:
    data = _encode(Image.new("RGB", (400, 300)), "PNG")
    with pytest.raises(InvalidRequestError, match="pixels"):
        process_image(data, ImageProcessorConfig(max_source_pixels=400 * 300 - 1, **SMALL))
    with pytest.raises(InvalidRequestError, match="pixels"):
        process_image(Image.open(io.BytesIO(data)), ImageProcessorConfig(max_source_pixels=10))


def test_extreme_aspect_ratio() -> None:
    with pytest.raises(InvalidRequestError, match="aspect"):
        process_image(_encode(Image.new("RGB", (402, 2)), "PNG"), ImageProcessorConfig(**SMALL))


@pytest.mark.parametrize(("h", "w"), [(0, 10), (10, 0), (-3, 5)])
def test_smart_resize_rejects_non_positive(h: int, w: int) -> None:
    with pytest.raises(InvalidRequestError):
        smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1280)


def test_rejects_non_image_object() -> None:
    with pytest.raises(InvalidRequestError):
        process_image("a string", ImageProcessorConfig())  # type: ignore[arg-type]


# ---- precomputed patches -----------------------------------------------------------------------


def test_validate_patches_accepts_processed_output() -> None:
    cfg = ImageProcessorConfig(**SMALL)
    ref = process_image(_image(100, 150), cfg)
    out = validate_patches(ref.patches, ref.grid_thw, cfg)
    assert out.grid_thw == ref.grid_thw
    assert np.array_equal(out.patches, ref.patches)
    assert validate_patches(ref.patches, list(ref.grid_thw), cfg).grid_thw == ref.grid_thw


@pytest.mark.parametrize(
    ("shape", "grid", "dtype"),
    [
        ((16, 1176), (1, 4, 4), np.float16),  # wrong dtype
        ((16, 1175), (1, 4, 4), np.float32),  # wrong patch dim
        ((15, 1176), (1, 4, 4), np.float32),  # wrong patch count
        ((12, 1176), (1, 3, 4), np.float32),  # h not a multiple of merge_size
        ((16, 1176), (1, 4, 4, 1), np.float32),  # not three values
        ((16, 1176), (0, 4, 4), np.float32),  # non-positive
        ((16, 1176), (1.0, 4, 4), np.float32),  # not ints
        ((1176,), (1, 4, 4), np.float32),  # 1-D
        ((2 * 402, 1176), (1, 2, 402), np.float32),  # aspect ratio over 200
        ((4096, 1176), (1, 64, 64), np.float32),  # more than max_pixels
    ],
)
def test_validate_patches_rejects(shape: tuple, grid: tuple, dtype: type) -> None:
    cfg = ImageProcessorConfig(**SMALL)
    patches = np.zeros(shape, dtype=dtype)
    assert validate_patches(np.zeros((16, 1176), np.float32), (1, 2, 8), cfg).grid_thw == (1, 2, 8)
    with pytest.raises(InvalidRequestError):
        validate_patches(patches, grid, cfg)  # type: ignore[arg-type]


def test_validate_patches_rejects_non_finite_and_non_arrays() -> None:
    cfg = ImageProcessorConfig(**SMALL)
    patches = np.zeros((16, 1176), np.float32)
    patches[3, 5] = float("nan")
    with pytest.raises(InvalidRequestError, match="NaN"):
        validate_patches(patches, (1, 4, 4), cfg)
    with pytest.raises(InvalidRequestError, match="must be an array"):
        validate_patches([[0.0] * 1176] * 16, (1, 4, 4), cfg)  # type: ignore[arg-type]


# ---- config ------------------------------------------------------------------------------------


def test_from_dir_defaults_without_file(tmp_path) -> None:
    assert ImageProcessorConfig.from_dir(tmp_path) == ImageProcessorConfig()


def test_from_dir_reads_transformers_5_file(tmp_path) -> None:
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 100)
    proc.save_pretrained(tmp_path)
    cfg = ImageProcessorConfig.from_dir(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels) == (28 * 28 * 4, 28 * 28 * 100)
    assert cfg.image_mean == pytest.approx(proc.image_mean)
    assert cfg.image_std == pytest.approx(proc.image_std)
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (14, 2, 2)


def test_from_dir_reads_old_keys_and_size_dict(tmp_path) -> None:
    raw = {
        "min_pixels": 1000,
        "max_pixels": 50000,
        "merge_size": 2,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "unknown": 1,
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    cfg = ImageProcessorConfig.from_dir(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (1000, 50000, (0.5, 0.5, 0.5))
    raw = {"size": {"min_pixels": 2000, "max_pixels": 60000}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    cfg = ImageProcessorConfig.from_dir(tmp_path, max_image_bytes=123)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.max_image_bytes) == (2000, 60000, 123)


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"size": 5}),
        json.dumps({"min_pixels": 0}),
        json.dumps({"min_pixels": 5000, "max_pixels": 4000}),
        json.dumps({"patch_size": "14"}),
        json.dumps({"image_std": [0.5, 0.0, 0.5]}),
        json.dumps({"image_mean": [0.5, 0.5]}),
        json.dumps({"resample": 99}),
        json.dumps({"image_mean": 0.5}),
        json.dumps({"image_std": ["a", "b", "c"]}),
        json.dumps({"rescale_factor": "x"}),
        json.dumps({"do_normalize": "yes"}),
    ],
)
def test_from_dir_bad_file(tmp_path, text: str) -> None:
    (tmp_path / "preprocessor_config.json").write_text(text)
    with pytest.raises(ConfigError):
        ImageProcessorConfig.from_dir(tmp_path)
