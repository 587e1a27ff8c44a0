"""The router's request preparation for the Qwen3 families (Qwen3-VL, Qwen3.5) gives the tokens
the engine gives for the same request: a video becomes one block per temporal patch after its
timestamp (the frames' own, or derived from ``second_per_grid`` for patches), images and videos
use the patch-16 geometry (the vision tower's when the checkpoint has no
``preprocessor_config.json``), and the prepared prompt passes the engine's own validation.

The oracle is ``LLMEngine.prepare`` (text) and ``build_state`` (the Qwen3 rope index over the
prepared ids); the layout itself is held against transformers' processor in
tests/engine/multimodal/test_qwen3_processors.py.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.builtin.tiny_qwen3 import write_tiny_qwen3_model
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput, VideoInput, build_state, video_from_array
from engine.multimodal.video_timestamps import timestamp_text
from proto.convert import patches_message, video_patches
from proto.pdserve.v1 import generate_pb2 as gpb
from router.config import VideoLimits
from router.preprocess import ModelAssets, Preprocessor

LIMITS = VideoLimits(max_videos=2, max_frames=8, max_patch_bytes=8 << 20)


def _png(seed: int, height: int = 64, width: int = 96) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(num_pages=32, page_size=8))


def _prep(model_dir: Path) -> Preprocessor:
    return Preprocessor(ModelAssets.from_dir(model_dir), 8, max_images=2, video_limits=LIMITS)


def _engine_video(out_video: gpb.Video, stamps: tuple[float, ...]) -> VideoInput:
    patches, grid, seconds = video_patches(out_video)
    video = video_from_array(patches, grid, seconds)
    return VideoInput(video.patches, video.grid_thw, video.second_per_grid, stamps)


def test_a_frames_video_becomes_timestamped_frame_blocks(model_dir: Path,
                                                          engine: LLMEngine) -> None:
    prep = _prep(model_dir)
    frames = [_png(s) for s in range(6)]
    req = gpb.GenerateRequest(text="what happens <|vision_start|><|video_pad|><|vision_end|> ?",
                              videos=[gpb.Video(frames=gpb.VideoFrames(frames=frames, fps=2.0))])
    out = prep.prepare(req)
    [video] = out.videos
    grid_t = video.patches.grid_thw[0]
    assert grid_t >= 2  # several temporal patches, each its own block
    stamps = prep._video(0, req.videos[0])[1]
    assert len(stamps) == grid_t and list(stamps) == sorted(stamps)
    want = engine.prepare(Prompt(text=req.text, videos=[_engine_video(video, stamps)]))
    assert out.token_ids == want.token_ids
    tok = prep.assets.tokenizer
    assert tok is not None
    first = tok.encode(timestamp_text(stamps[0]))
    cfg = prep.assets.config
    runs = sum(1 for i, t in enumerate(out.token_ids) if t == cfg.video_token_id
               and out.token_ids[i - 1] != cfg.video_token_id)
    assert runs == grid_t
    assert any(out.token_ids[i : i + len(first)] == first for i in range(len(out.token_ids)))
    build_state(out.token_ids, [], cfg, [_engine_video(video, stamps)])


def test_one_video_placeholder_in_token_ids_is_expanded_as_text_would_be(
        model_dir: Path, engine: LLMEngine) -> None:
    prep = _prep(model_dir)
    cfg = prep.assets.config
    patches = np.random.default_rng(3).standard_normal((2 * 4 * 4, cfg.vision.patch_dim))
    video = gpb.Video(patches=patches_message(patches.astype(np.float32), (2, 4, 4)),
                      second_per_grid=0.5)
    image_patches = np.random.default_rng(4).standard_normal((1 * 4 * 6, cfg.vision.patch_dim))
    image = gpb.Image(patches=patches_message(image_patches.astype(np.float32), (1, 4, 6)))
    tok = prep.assets.tokenizer
    assert tok is not None
    text = "a <|vision_start|><|image_pad|><|vision_end|> then <|vision_start|><|video_pad|>" \
           "<|vision_end|> end"
    from_ids = prep.prepare(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=tok.encode(text)),
                                                images=[image], videos=[video]))
    from_text = prep.prepare(gpb.GenerateRequest(text=text, images=[image], videos=[video]))
    assert from_ids.token_ids == from_text.token_ids
    stamps = prep._video(0, video)[1]
    assert stamps == (0.125, 0.625)  # 4 frames at 4 fps: the mean time of each pair
    img = ImageInput(torch.from_numpy(image_patches.astype(np.float32)), (1, 4, 6))
    want = engine.prepare(Prompt(text=text, images=[img],
                                 videos=[_engine_video(from_text.videos[0], stamps)]))
    assert from_text.token_ids == want.token_ids
    # the expanded prompt goes through as it is
    again = prep.prepare(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=from_ids.token_ids),
                                             images=[image], videos=[video]))
    assert again.token_ids == from_ids.token_ids


def test_a_checkpoint_without_preprocessor_files_uses_the_towers_geometry(
        hf35_dir: Path) -> None:
    """transformers' own Qwen3.5 checkpoint has no preprocessor json: patch 16, not 14."""
    assets = ModelAssets.from_dir(hf35_dir)
    assert assets.image_config.patch_size == 16
    assert assets.video_config.frame.patch_size == 16
    assert assets.video_config.family == "qwen3_vl"
    prep = Preprocessor(assets, 8, max_images=2, video_limits=LIMITS)
    cfg = assets.config
    patches = np.zeros((1 * 4 * 6, cfg.vision.patch_dim), dtype=np.float32)
    out = prep.prepare(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=[5, cfg.vision_start_token_id, cfg.image_token_id,
                                    cfg.vision_end_token_id, 6]),
        images=[gpb.Image(patches=patches_message(patches, (1, 4, 6)))]))
    assert out.token_ids.count(cfg.image_token_id) == 6
    video = gpb.Video(patches=patches_message(np.zeros((2 * 16, cfg.vision.patch_dim),
                                                       dtype=np.float32), (2, 4, 4)))
    with pytest.raises(InvalidRequestError, match="needs the model's tokenizer.json"):
        prep.prepare(gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=[5, cfg.video_token_id, 6]), videos=[video]))
