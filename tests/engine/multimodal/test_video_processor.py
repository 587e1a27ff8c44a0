"""engine.multimodal.video_processor against the image processor (the oracle).

Qwen2-VL tiles an image over the temporal patch, so a video of ``T`` identical frames must give
exactly the image processor's patches and grid; in general, temporal slot ``k`` of grid step
``g`` holds frame ``g * T + k`` exactly as the image processor lays that frame out.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.errors import ConfigError, InvalidRequestError
from engine.multimodal.image_processor import ImageProcessorConfig, process_image
from engine.multimodal.video_processor import (
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VideoProcessorConfig,
    process_video,
    validate_video_patches,
)

FRAME = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 6)
CFG = VideoProcessorConfig(frame=FRAME, max_frames=8)
T, P = FRAME.temporal_patch_size, FRAME.patch_size


def _frame(seed: int, height: int = 50, width: int = 70) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _slot(patches: np.ndarray, k: int) -> np.ndarray:
    """Temporal slot ``k`` of every patch: ``[n, C, P, P]``."""
    return patches.reshape(patches.shape[0], 3, T, P, P)[:, :, k]


def test_identical_frames_equal_the_image_processor() -> None:
    frame = _frame(0)
    video = process_video([frame] * T, CFG)
    image = process_image(frame, FRAME)
    assert video.grid_thw == image.grid_thw
    assert np.array_equal(video.patches, image.patches)
    assert video.second_per_grid == pytest.approx(T / 2.0)


def test_each_temporal_slot_is_its_frame_as_an_image() -> None:
    frames = [_frame(seed) for seed in range(4)]
    video = process_video(frames, CFG, fps=4.0)
    t, h, w = video.grid_thw
    assert t == 2 and video.second_per_grid == pytest.approx(T / 4.0)
    steps = video.patches.reshape(t, h * w, -1)
    for g in range(t):
        for k in range(T):
            image = process_image(frames[g * T + k], FRAME)
            assert image.grid_thw == (1, h, w)
            assert np.array_equal(_slot(steps[g], k), _slot(image.patches, 0))


def test_frame_count_is_padded_with_the_last_frame() -> None:
    frames = [_frame(seed) for seed in range(3)]
    padded = process_video(frames, CFG)
    explicit = process_video(frames + [frames[-1]], CFG)
    assert padded.grid_thw == explicit.grid_thw == (2, *padded.grid_thw[1:])
    assert np.array_equal(padded.patches, explicit.patches)


def test_validate_video_patches_accepts_processor_output() -> None:
    video = process_video([_frame(seed) for seed in range(4)], CFG)
    out = validate_video_patches(video.patches, video.grid_thw, 0.5, CFG)
    assert out.grid_thw == video.grid_thw and out.second_per_grid == 0.5
    with pytest.raises(InvalidRequestError, match="grid t"):
        validate_video_patches(video.patches, (CFG.max_grid_t + 1, 2, 2), 1.0, CFG)
    with pytest.raises(InvalidRequestError, match="second_per_grid"):
        validate_video_patches(video.patches, video.grid_thw, float("nan"), CFG)
    with pytest.raises(InvalidRequestError, match="shape"):
        validate_video_patches(video.patches[1:], video.grid_thw, 1.0, CFG)


@pytest.mark.parametrize(
    ("frames", "fps", "message"),
    [
        ([], None, "no frames"),
        ([_frame(0)] * 9, None, "more than the limit of 8"),
        ([_frame(0), b"not an image"], None, "frame 1: cannot decode"),
        ([_frame(0), b""], None, "frame 1: image data is empty"),
        ([_frame(0), _frame(1, height=56)], None, "frame 1 is 70x56 but frame 0 is 70x50"),
        ([_frame(0)], -1.0, "fps"),
        ([_frame(0)], float("inf"), "fps"),
    ],
)
def test_bad_videos_are_refused(frames: list[bytes], fps: float | None, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        process_video(frames, CFG, fps=fps)


def test_patch_byte_limit_is_checked_before_resizing() -> None:
    small = VideoProcessorConfig(frame=FRAME, max_patch_bytes=1000)
    with pytest.raises(InvalidRequestError, match="more than the limit of 1000"):
        process_video([_frame(0)] * 2, small)


def test_config_from_dir(tmp_path: Path) -> None:
    assert VideoProcessorConfig.from_dir(tmp_path).frame.max_pixels == VIDEO_MAX_PIXELS
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 28 * 28 * 999}))
    from_image = VideoProcessorConfig.from_dir(tmp_path)
    assert from_image.frame.max_pixels == 28 * 28 * 999
    assert from_image.frame.min_pixels == VIDEO_MIN_PIXELS
    video_file = {"size": {"shortest_edge": 3136, "longest_edge": 12544}, "fps": 1.0,
                  "max_frames": 32, "temporal_patch_size": 2}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_file))
    cfg = VideoProcessorConfig.from_dir(tmp_path, max_frames=4)
    assert (cfg.frame.min_pixels, cfg.frame.max_pixels, cfg.fps, cfg.max_frames) == (
        3136, 12544, 1.0, 4)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 0}))
    with pytest.raises(ConfigError, match="fps"):
        VideoProcessorConfig.from_dir(tmp_path)
