"""Videos through the router's request preparation (``router.preprocess.Preprocessor``).

Oracles: the engine's video processor for the patches, the engine's own prompt validation
(``engine.multimodal.inputs.build_state``, with its rope index) for the prepared token ids, and the
placeholder rule shared with ``LLMEngine.prepare`` (image blocks, then video blocks, then the text
when the text has no placeholders).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.errors import InvalidRequestError
from engine.multimodal.image_processor import num_image_tokens, process_image
from engine.multimodal.inputs import ImageInput, build_state, image_from_array, video_from_array
from engine.multimodal.video_processor import process_video
from proto.convert import patches_array, patches_message, video_patches
from proto.pdserve.v1 import generate_pb2 as gpb
from router.config import RouterConfig, VideoLimits
from router.preprocess import ModelAssets, PreparedRequest, Preprocessor

LIMITS = VideoLimits(max_videos=2, max_frames=6, max_patch_bytes=1 << 20)


@pytest.fixture(scope="module")
def prep(tiny_dir: Path) -> Preprocessor:
    return Preprocessor(ModelAssets.from_dir(tiny_dir), 8, max_images=2, video_limits=LIMITS)


def _png(seed: int, height: int = 40, width: int = 60) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


FRAMES = [_png(seed) for seed in range(3)]


def _frames_video(frames: list[bytes], fps: float = 0.0, seconds: float = 0.0) -> gpb.Video:
    return gpb.Video(frames=gpb.VideoFrames(frames=frames, fps=fps), second_per_grid=seconds)


def _check_with_engine(prep: Preprocessor, out: PreparedRequest) -> None:
    """The engine accepts the prepared prompt with the prepared images and videos."""
    images = [image_from_array(*patches_array(m)) for m in out.images]
    videos = [video_from_array(*video_patches(v)) for v in out.videos]
    build_state(out.token_ids, images, prep.assets.config, videos)


def _blocks(prep: Preprocessor, pad: int, counts: list[int]) -> list[int]:
    cfg = prep.assets.config
    out: list[int] = []
    for n in counts:
        out += [cfg.vision_start_token_id, *[pad] * n, cfg.vision_end_token_id]
    return out


def test_frames_video_and_image_before_text(prep: Preprocessor) -> None:
    cfg, tok = prep.assets.config, prep.assets.tokenizer
    assert tok is not None
    req = gpb.GenerateRequest(text="what happens?", images=[gpb.Image(encoded=_png(9))],
                              videos=[_frames_video(FRAMES, fps=4.0)])
    out = prep.prepare(req)
    oracle = process_video(FRAMES, prep.video_config, fps=4.0)
    (video,) = out.videos
    array, grid, seconds = video_patches(video)
    assert grid == oracle.grid_thw and grid[0] == 2  # 3 frames padded to 4
    assert np.array_equal(array, oracle.patches)
    assert seconds == pytest.approx(cfg.vision.temporal_patch_size / 4.0)
    merge = cfg.vision.spatial_merge_size
    image = process_image(_png(9), prep.assets.image_config)
    expected = (_blocks(prep, cfg.image_token_id, [num_image_tokens(image.grid_thw, merge)])
                + _blocks(prep, cfg.video_token_id, [num_image_tokens(grid, merge)])
                + tok.encode("what happens?"))
    assert out.token_ids == expected
    _check_with_engine(prep, out)


def test_placeholders_in_text_keep_their_places(prep: Preprocessor) -> None:
    cfg = prep.assets.config
    text = "a <|vision_start|><|video_pad|><|vision_end|> b <|vision_start|><|video_pad|>" \
           "<|vision_end|> c"
    req = gpb.GenerateRequest(text=text, videos=[_frames_video(FRAMES[:2]),
                                                 _frames_video(FRAMES[1:], seconds=0.25)])
    out = prep.prepare(req)
    assert [video_patches(v)[2] for v in out.videos] == [pytest.approx(1.0), 0.25]  # T / 2 fps
    ids = np.asarray(out.token_ids)
    runs = np.flatnonzero(np.diff(np.r_[0, ids == cfg.video_token_id, 0]))  # run edges
    merge = cfg.vision.spatial_merge_size
    lengths = [num_image_tokens(video_patches(v)[1], merge) for v in out.videos]
    assert list(runs[1::2] - runs[::2]) == lengths
    _check_with_engine(prep, out)


def test_token_id_prompts_one_pad_or_expanded(prep: Preprocessor) -> None:
    cfg = prep.assets.config
    video = _frames_video(FRAMES[:2])
    one = prep.prepare(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=[1, cfg.vision_start_token_id, cfg.video_token_id,
                                    cfg.vision_end_token_id, 2]), videos=[video]))
    again = prep.prepare(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=one.token_ids),
                                             videos=[video]))
    assert again.token_ids == one.token_ids and len(one.token_ids) > 5
    _check_with_engine(prep, one)
    with pytest.raises(InvalidRequestError, match="2 video placeholder tokens but 1 videos"):
        prep.prepare(gpb.GenerateRequest(token_ids=gpb.TokenIds(
            ids=[cfg.video_token_id, 5, cfg.video_token_id]), videos=[video]))
    with pytest.raises(InvalidRequestError, match="video"):  # pads without a video
        prep.prepare(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[cfg.video_token_id, 5])))


def test_patches_video_defaults_to_one_second_per_grid(prep: Preprocessor) -> None:
    oracle = process_video(FRAMES[:2], prep.video_config)
    patches = patches_message(oracle.patches, oracle.grid_thw)
    for seconds, expected in ((0.0, 1.0), (0.5, 0.5)):
        out = prep.prepare(gpb.GenerateRequest(
            text="x", videos=[gpb.Video(patches=patches, second_per_grid=seconds)]))
        array, grid, got = video_patches(out.videos[0])
        assert (grid, got) == (oracle.grid_thw, expected)
        assert np.array_equal(array, oracle.patches)


def _patches_video(grid: tuple[int, int, int], width: int = 1176) -> gpb.Video:
    array = np.zeros((grid[0] * grid[1] * grid[2], width), dtype=np.float32)
    return gpb.Video(patches=patches_message(array, grid))


@pytest.mark.parametrize(
    ("videos", "message"),
    [
        ([_frames_video(FRAMES[:1])] * 3, "3 videos is more than the limit of 2"),
        ([_frames_video(FRAMES * 3)], "video 0: the video has 9 frames, more than the limit of 6"),
        ([_frames_video([_png(0, 600, 900)] * 3)], "video 0: .* bytes, more than the limit"),
        ([_patches_video((4, 2, 2))], "video 0: video grid t must be in \\[1, 3\\]"),
        ([_patches_video((1, 2, 2), width=12)], "video 0: patches shape \\(4, 12\\)"),
        ([gpb.Video()], "video 0: the video is empty"),
        ([_frames_video([])], "video 0: the video has no frames"),
        ([_frames_video([FRAMES[0], b"junk"])], "video 0: video frame 1: cannot decode"),
        ([_frames_video([FRAMES[0], _png(1, 41)])], "video 0: video frame 1 is 60x41"),
        ([_frames_video(FRAMES, fps=-1.0)], "video 0: video fps"),
        ([_frames_video(FRAMES, seconds=float("nan"))], "video 0: second_per_grid"),
        ([_frames_video(FRAMES[:1]), _frames_video(FRAMES, seconds=-2.0)],
         "video 1: second_per_grid"),
    ],
)
def test_bad_videos_are_invalid_argument(
    prep: Preprocessor, videos: list[gpb.Video], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        prep.prepare(gpb.GenerateRequest(text="x", videos=videos))


def test_video_limits_config() -> None:
    assert RouterConfig(Path("m"), colocated=("h:1",)).video_limits == VideoLimits()
    with pytest.raises(ValueError, match="video limits"):
        VideoLimits(max_frames=0)
    no_videos = VideoLimits(max_videos=0)
    assert no_videos.max_videos == 0


def test_images_are_unchanged_by_video_support(prep: Preprocessor) -> None:
    out = prep.prepare(gpb.GenerateRequest(text="x", images=[gpb.Image(encoded=_png(3))]))
    assert out.videos == []
    image = process_image(_png(3), prep.assets.image_config)
    build_state(out.token_ids, [ImageInput(torch.from_numpy(image.patches), image.grid_thw)],
                prep.assets.config)
