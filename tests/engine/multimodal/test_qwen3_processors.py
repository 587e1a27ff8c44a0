"""Qwen3-VL / Qwen3.5 preprocessing against transformers' own processors (the oracles).

Images: Qwen3-VL uses transformers' Qwen2-VL image processor with its own settings (patch 16,
mean and std 0.5, ``size`` limits); the PIL one is the oracle, as for Qwen2-VL. Videos:
``Qwen3VLVideoProcessor`` and the whole ``Qwen3VLProcessor`` (prompt ids with the frame
timestamps). transformers' video processors run only on its torchvision backend, and the
torchvision wheels this machine can install need CUDA torch; where torchvision is missing, the
three torchvision functions transformers calls (``resize``, ``normalize``,
``grayscale_to_rgb``) are stood in for by what torchvision does on the CPU: ``resize`` of a uint8
image is torch's own ``interpolate(mode="bicubic", antialias=True)`` on the uint8 tensor, so the
numbers still come from torch.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from engine.builtin.tiny_tokenizer import special_token_ids
from engine.errors import ConfigError, InvalidRequestError
from engine.multimodal.image_processor import (
    ImageProcessorConfig,
    expand_image_placeholders,
    num_image_tokens,
    process_image,
)
from engine.multimodal.qwen3_video import sample_frame_indices, video_smart_resize
from engine.multimodal.torchvision_compat import normalize_lut, resize_bicubic
from engine.multimodal.video_processor import (
    QWEN2_VL,
    QWEN3_VL,
    VideoProcessorConfig,
    process_video,
)
from engine.multimodal.video_timestamps import (
    default_timestamps,
    expand_video_frames,
    frame_timestamps,
)
from engine.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
qwen2_vl_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
qwen3_vl_video = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
qwen3_vl_proc = pytest.importorskip("transformers.models.qwen3_vl.processing_qwen3_vl")
from transformers.image_utils import PILImageResampling  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

TOKENIZER = Path(__file__).parents[3] / "engine/builtin/tiny-qwen2-vl/tokenizer.json"
# Qwen3-VL's published files, with smaller pixel limits where noted to keep the tests fast
QWEN3_IMAGE_FILE = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN3_VIDEO_FILE = {
    "size": {"longest_edge": 32 * 32 * 96, "shortest_edge": 4096},  # published: 25165824
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor",
    "cap_pixels_per_frame": False,
}


class _Mode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _tv_resize(image: torch.Tensor, size: list[int], interpolation: _Mode = _Mode.BILINEAR,
               antialias: bool = True) -> torch.Tensor:
    """torchvision's ``resize`` of a CPU uint8 tensor with bicubic: native uint8 interpolate."""
    chans, height, width = image.shape[-3:]
    if tuple(size) == (height, width):
        return image
    assert interpolation is _Mode.BICUBIC and image.dtype == torch.uint8 and antialias
    flat = image.reshape(-1, chans, height, width)
    out = torch.nn.functional.interpolate(flat, size=list(size), mode="bicubic",
                                          align_corners=False, antialias=True)
    return out.reshape(*image.shape[:-3], chans, *size)


def _tv_normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
    mean_t = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image.sub_(mean_t) if inplace else image.sub(mean_t)).div_(std_t)


def _tv_grayscale_to_rgb(image: torch.Tensor) -> torch.Tensor:
    return image if image.shape[-3] == 3 else image.repeat_interleave(3, dim=-3)


@pytest.fixture(scope="module", autouse=True)
def _torchvision() -> Iterator[None]:
    """Stand in for torchvision's functional API where it is not installed (see above)."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    import transformers.image_processing_backends as backends
    import transformers.processing_utils as processing
    import transformers.video_processing_utils as video_utils

    tv = types.SimpleNamespace(InterpolationMode=_Mode, resize=_tv_resize,
                               normalize=_tv_normalize, grayscale_to_rgb=_tv_grayscale_to_rgb)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backends, "tvF", tv, raising=False)
        mp.setattr(video_utils, "tvF", tv, raising=False)
        mp.setattr(backends, "pil_torch_interpolation_mapping",
                   {PILImageResampling.BICUBIC: _Mode.BICUBIC})
        # the processor checks its video processor against this (a placeholder without it)
        mp.setattr(processing.transformers_module, "VideoProcessorMixin",
                   video_utils.VideoProcessorMixin, raising=False)
        yield


def _write(directory: Path, name: str, data: dict) -> Path:
    (directory / name).write_text(json.dumps(data))
    return directory


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _video(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """``[F, H, W, 3]`` uint8: smooth motion plus noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for f in range(frames):
        base = np.stack([(xx + 5 * f) % 256, (yy * 3 + f) % 256, (xx + yy) % 256], -1)
        out[f] = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    return out


# ---------------------------------------------------------------- images


@pytest.mark.parametrize(
    ("height", "width", "longest_edge"),
    [
        (40, 50, None),  # small: scaled up to shortest_edge
        (80, 900, None),  # wide
        (600, 90, None),  # tall
        (333, 517, None),  # inside the limits: only rounded to 32
        (700, 900, 32 * 32 * 256),  # larger than the maximum: scaled down
        (5, 700, 32 * 32 * 256),  # thin: aspect 140
    ],
)
def test_images_match_transformers(tmp_path: Path, height: int, width: int,
                                   longest_edge: int | None) -> None:
    file = dict(QWEN3_IMAGE_FILE)
    if longest_edge is not None:
        file["size"] = {"longest_edge": longest_edge, "shortest_edge": 65536}
    _write(tmp_path, "preprocessor_config.json", file)
    cfg = ImageProcessorConfig.from_dir(tmp_path)
    assert (cfg.patch_size, cfg.merge_size, cfg.image_mean) == (16, 2, (0.5, 0.5, 0.5))
    oracle = qwen2_vl_pil.Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    img = _image(height, width, seed=height + width)
    ours = process_image(img, cfg)
    ref = oracle(images=[img], return_tensors="np")
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert ours.patches.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(ours.patches, ref["pixel_values"], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- video pieces


@settings(max_examples=40, deadline=None)
@given(height=st.integers(1, 400), width=st.integers(1, 400), out_h=st.integers(2, 300),
       out_w=st.integers(1, 300), seed=st.integers(0, 1000))
def test_resize_bicubic_matches_torch(height: int, width: int, out_h: int, out_w: int,
                                      seed: int) -> None:
    pixels = np.array(_image(height, width, seed))
    tensor = torch.from_numpy(pixels).permute(2, 0, 1)[None].contiguous()
    ref = torch.nn.functional.interpolate(tensor, size=[out_h, out_w], mode="bicubic",
                                          align_corners=False, antialias=True)
    ours = resize_bicubic(pixels, out_h, out_w)
    assert np.array_equal(ours, ref[0].permute(1, 2, 0).numpy())


@pytest.mark.parametrize("mean_std", [((0.5,) * 3, (0.5,) * 3),
                                      ((0.48145466, 0.4578275, 0.40821073),
                                       (0.26862954, 0.26130258, 0.27577711))])
@pytest.mark.parametrize(("do_rescale", "do_normalize"),
                         [(True, True), (True, False), (False, True)])
def test_normalize_lut_matches_transformers(mean_std: tuple, do_rescale: bool,
                                            do_normalize: bool) -> None:
    mean, std = mean_std
    cfg = ImageProcessorConfig(image_mean=mean, image_std=std, do_rescale=do_rescale,
                               do_normalize=do_normalize)
    levels = torch.arange(256, dtype=torch.uint8).expand(1, 3, 1, 256).contiguous()
    ref = qwen3_vl_video.Qwen3VLVideoProcessor().rescale_and_normalize(
        levels, do_rescale, cfg.rescale_factor, do_normalize, mean, std)
    assert np.array_equal(normalize_lut(cfg), ref[0, :, 0].numpy())


@pytest.mark.parametrize("total", [1, 2, 3, 7, 30, 61, 200])
@pytest.mark.parametrize("video_fps", [1.0, 2.0, 7.5, 24.0, 29.97])
def test_frame_sampling_matches_transformers(total: int, video_fps: float) -> None:
    oracle = qwen3_vl_video.Qwen3VLVideoProcessor(min_frames=4, max_frames=40)
    expected = oracle.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps), fps=2)
    assert sample_frame_indices(total, video_fps, 2.0, 4, 40) == expected.tolist()


@settings(max_examples=300, deadline=None)
@given(frames=st.integers(1, 100), height=st.integers(1, 5000), width=st.integers(1, 5000),
       min_pixels=st.integers(1, 32 * 32 * 64), extra=st.integers(0, 32 * 32 * 4096))
def test_video_smart_resize_matches_transformers(frames: int, height: int, width: int,
                                                 min_pixels: int, extra: int) -> None:
    max_pixels = max(min_pixels, 32 * 32) + extra
    args = (frames, height, width, 2, 32, min_pixels, max_pixels)
    try:
        expected = qwen3_vl_video.smart_resize(*args)
    except ValueError:
        with pytest.raises(InvalidRequestError):
            video_smart_resize(*args)
        return
    assert video_smart_resize(*args) == tuple(expected)


def test_frame_timestamps() -> None:
    oracle = qwen3_vl_proc.Qwen3VLProcessor._calculate_timestamps
    for indices, fps in (([0, 6, 12, 17, 23, 29], 10.0), ([0, 3, 5], 2.0), ([4], 29.97)):
        assert frame_timestamps(indices, fps, 2) == oracle(None, list(indices), fps, 2)
    assert frame_timestamps([0, 1, 2, 3, 4, 5], 3.0, 3) == pytest.approx([1 / 3, 4 / 3])
    assert default_timestamps(3, 1.0, 2) == [0.25, 1.25, 2.25]


# ---------------------------------------------------------------- whole videos


def _qwen3_video_dir(tmp_path: Path, **changes: Any) -> Path:
    return _write(tmp_path, "video_preprocessor_config.json", {**QWEN3_VIDEO_FILE, **changes})


def _frames(video: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(f, "RGB") for f in video]


@pytest.mark.parametrize(
    ("frames", "height", "width", "fps", "changes"),
    [
        (30, 60, 90, 10.0, {}),  # sampled down to 2 fps (6 of 30 frames)
        (5, 64, 80, 2.0, {}),  # already at 2 fps, odd count: the last frame pads
        (3, 20, 300, 2.0, {}),  # fewer frames than min_frames; a side below 32 scaled up
        (8, 200, 300, 1.0, {}),  # fps below the sampling rate: every frame, scaled down
        (12, 24, 40, 6.0, {"size": {"longest_edge": 32 * 32 * 96,
                                    "shortest_edge": 32 * 32 * 40}}),  # scaled up to min
        (9, 100, 160, 3.0, {"cap_pixels_per_frame": True, "max_video_tokens": 8}),
        (40, 48, 64, 20.0, {"fps": 4, "min_frames": 6, "max_frames": 6}),
    ],
)
def test_videos_match_transformers(tmp_path: Path, frames: int, height: int, width: int,
                                   fps: float, changes: dict) -> None:
    directory = _qwen3_video_dir(tmp_path, **changes)
    cfg = VideoProcessorConfig.from_dir(directory)
    assert cfg.family == QWEN3_VL
    oracle = qwen3_vl_video.Qwen3VLVideoProcessor.from_pretrained(directory)
    video = _video(frames, height, width, seed=frames)
    ref = oracle(videos=[video], video_metadata=[{"fps": fps, "total_num_frames": frames}],
                 return_metadata=True, return_tensors="np")
    ours = process_video(_frames(video), cfg, fps=fps)
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    assert ours.patches.shape == ref["pixel_values_videos"].shape
    np.testing.assert_allclose(ours.patches, ref["pixel_values_videos"], atol=1e-6, rtol=0)
    meta = ref["video_metadata"][0]
    timestamps = qwen3_vl_proc.Qwen3VLProcessor._calculate_timestamps(
        None, meta.frames_indices, meta.fps, 2)
    assert list(ours.timestamps) == timestamps
    assert ours.second_per_grid == pytest.approx(2 / meta.sampled_fps)


def test_presampled_frames_get_the_default_timestamps(tmp_path: Path) -> None:
    cfg = VideoProcessorConfig.from_dir(_qwen3_video_dir(tmp_path))
    ours = process_video(_frames(_video(6, 40, 40, seed=1)), cfg)  # no fps: at the config's 2
    assert ours.second_per_grid == 1.0
    assert list(ours.timestamps) == default_timestamps(3, 1.0, 2) == [0.25, 1.25, 2.25]


def test_qwen3_refuses_a_one_frame_video(tmp_path: Path) -> None:
    cfg = VideoProcessorConfig.from_dir(_qwen3_video_dir(tmp_path))
    with pytest.raises(InvalidRequestError, match="at least 2 frames"):
        process_video(_frames(_video(1, 40, 40, seed=0)), cfg, fps=2.0)


def test_family_selection(tmp_path: Path) -> None:
    assert VideoProcessorConfig.from_dir(tmp_path).family == QWEN2_VL
    _write(tmp_path, "preprocessor_config.json", {"patch_size": 16})
    by_type = VideoProcessorConfig.from_dir(tmp_path, family=QWEN3_VL)  # model type's choice
    assert by_type.family == QWEN3_VL
    assert (by_type.frame.min_pixels, by_type.frame.max_pixels) == (128 * 32 * 32, 768 * 32 * 32)
    assert by_type.frame.image_mean == (0.5, 0.5, 0.5)
    cfg = VideoProcessorConfig.from_dir(_qwen3_video_dir(tmp_path, fps=1, min_frames=2,
                                                         max_frames=64))
    assert (cfg.family, cfg.fps, cfg.min_frames, cfg.max_sampled_frames) == (QWEN3_VL, 1, 2, 64)
    assert cfg.frame.max_pixels == 32 * 32 * 96
    with pytest.raises(ConfigError, match="bicubic"):
        VideoProcessorConfig.from_dir(_qwen3_video_dir(tmp_path, resample=2))
    with pytest.raises(ConfigError, match="family"):
        VideoProcessorConfig(family="qwen9")


# ---------------------------------------------------------------- prompts


def test_expand_video_frames_layout() -> None:
    pad, start, end = 9, 7, 8
    ids = [1, start, pad, end, 2, pad, 3]

    def encode(text: str) -> list[int]:
        return [100 + len(text), ord(text[1])]

    out = expand_video_frames(ids, pad, start, end, [2, 1], [[0.25, 1.25], [0.5]], encode)
    first = [[113, ord("0")], [start, pad, pad, end], [113, ord("1")], [start, pad, pad, end]]
    second = [[113, ord("0")], [start, pad, end]]
    # the wrapped first placeholder loses its wrapper (each block has its own), the bare one
    # is replaced alone
    assert out == [1, *sum(first, []), 2, *sum(second, []), 3]
    with pytest.raises(InvalidRequestError, match="2 video placeholders but 1 videos"):
        expand_video_frames(ids, pad, start, end, [1], [[0.0]], encode)


@pytest.mark.parametrize("text", [
    # a chat template's wrapped placeholders
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    "<|vision_start|><|video_pad|><|vision_end|>What moves? And here:"
    "<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n",
    # bare placeholders, each after a special token
    "<|im_start|><|image_pad|><|video_pad|> and <|im_end|><|video_pad|> so?",
])
def test_prompt_ids_match_the_transformers_processor(text: str) -> None:
    tok = Tokenizer.from_file(TOKENIZER)
    special = special_token_ids(tok.vocab_size)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))
    image_cfg = ImageProcessorConfig(min_pixels=4096, max_pixels=32 * 32 * 64, patch_size=16,
                                     image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    video_cfg = VideoProcessorConfig(frame=ImageProcessorConfig(
        min_pixels=4096, max_pixels=32 * 32 * 96, patch_size=16, image_mean=(0.5,) * 3,
        image_std=(0.5,) * 3), family=QWEN3_VL)
    processor = qwen3_vl_proc.Qwen3VLProcessor(
        image_processor=qwen2_vl_pil.Qwen2VLImageProcessorPil(
            patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
            size={"shortest_edge": 4096, "longest_edge": 32 * 32 * 64}),
        tokenizer=hf_tok,
        video_processor=qwen3_vl_video.Qwen3VLVideoProcessor(
            size={"shortest_edge": 4096, "longest_edge": 32 * 32 * 96},
            cap_pixels_per_frame=False))
    image = _image(50, 70, seed=3)
    videos = [_video(30, 60, 90, seed=4), _video(7, 40, 64, seed=5)]
    rates = [10.0, 29.97]
    ref = processor(text=[text], images=[image], videos=videos, return_tensors="np",
                    video_metadata=[{"fps": r, "total_num_frames": len(v)}
                                    for r, v in zip(rates, videos, strict=True)])
    ours_image = process_image(image, image_cfg)
    ours_videos = [process_video(_frames(v), video_cfg, fps=r)
                   for r, v in zip(rates, videos, strict=True)]
    image_pad, video_pad, start, end = (special[name] for name in (
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
    ids = expand_image_placeholders(tok.encode(text), image_pad,
                                    [num_image_tokens(ours_image.grid_thw, 2)])
    ids = expand_video_frames(
        ids, video_pad, start, end, [v.grid_thw[1] * v.grid_thw[2] // 4 for v in ours_videos],
        [v.timestamps for v in ours_videos], tok.encode)
    assert ids == ref["input_ids"][0].tolist()
    assert [list(v.grid_thw) for v in ours_videos] == ref["video_grid_thw"].tolist()
    np.testing.assert_allclose(np.concatenate([v.patches for v in ours_videos]),
                               ref["pixel_values_videos"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(ours_image.patches, ref["pixel_values"], atol=1e-6, rtol=0)
