"""The router's request preparation for the Qwen3 families (Qwen3-VL, Qwen3.5) gives the tokens
the engine gives for the same request: a video becomes one block per temporal patch after its
timestamp (the frames' own, or derived from ``second_per_grid`` for patches), images and videos
use the patch-16 geometry (the vision tower's when the checkpoint has no
``preprocessor_config.json``), and the prepared prompt passes the engine's own validation.

The oracle is ``LLMEngine.prepare`` (text) and ``build_state`` (the Qwen3 rope index over the
prepared ids); the layout itself is held against transformers' processor in
tests/engine/multimodal/test_qwen3_processors.py.

The second half sends text, one image, two images, a video (frames, and patches) and an image
with a video through the router for transformers' own Qwen3-VL, Qwen3.5 and (as a regression)
Qwen2-VL checkpoints, carries the prepared request over the wire to a decode worker's
conversion, and holds the request the worker builds (token ids, mrope table and delta, visual
inputs, prefix-cache keys) against ``LLMEngine.new_request`` of the same prompt given to the
engine directly. The workers need no timestamps: they are in the token ids, and the Qwen3 rope
index positions a video's frames by them.
"""

from __future__ import annotations

import io
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from decode_node.service import engine_inputs
from engine.builtin.tiny_qwen3 import write_tiny_qwen3_model
from engine.builtin.tiny_tokenizer import build_tiny_tokenizer
from engine.config import EngineConfig, ModelConfig
from engine.core.request import Request
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import (
    ImageInput,
    RequestState,
    VideoInput,
    build_state,
    video_from_array,
)
from engine.multimodal.prompt_layout import processor_configs
from engine.multimodal.video_processor import process_video
from engine.multimodal.video_timestamps import default_timestamps, timestamp_text
from proto.convert import patches_message, video_patches
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from router.config import VideoLimits
from router.preprocess import ModelAssets, PreparedRequest, Preprocessor

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


# ---- the router's prepared request, rebuilt by a worker, equals the engine's own ---------------
# transformers' own tiny checkpoints (tests/conftest.py) with a tiny tokenizer of 382 tokens,
# whose last ids (vision start, vision end, image pad, video pad = 378..381) are the checkpoints'

EQUAL_CHECKPOINTS = {"qwen2_vl": "hf_dir", "qwen3_vl": "hf3_dir", "qwen3_5": "hf35_dir"}
CLIP_FPS = 10.0  # twelve frames of it: Qwen3-VL keeps four, not evenly spaced in time
CLIP = [_png(20 + s) for s in range(12)]
CLIP_LIMITS = VideoLimits(max_videos=1, max_frames=len(CLIP), max_patch_bytes=32 << 20)
PHOTO = _png(30)
OTHER_PHOTO = _png(31, height=96, width=64)
CHAT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and "
        "<|vision_start|><|video_pad|><|vision_end|>what moves?<|im_end|>\n"
        "<|im_start|>assistant\n")


@dataclass(frozen=True)
class Case:
    """One request in both forms: the router's public message and the engine's own prompt."""

    request: gpb.GenerateRequest
    prompt: Prompt


@pytest.fixture(scope="module", params=sorted(EQUAL_CHECKPOINTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the kind's transformers checkpoint with a tokenizer whose specials match."""
    source = Path(request.getfixturevalue(EQUAL_CHECKPOINTS[request.param]))
    path = tmp_path_factory.mktemp(f"tok_{request.param}") / "ckpt"
    shutil.copytree(source, path)
    build_tiny_tokenizer(382).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def checkpoint_engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(num_pages=32, page_size=8))


def _engine_clip(model_dir: Path, frames: list[bytes], fps: float) -> VideoInput:
    """What a caller of the engine gives for a clip: the engine room's video processor's output
    with the checkpoint's settings, its timestamps (Qwen3) included; ``second_per_grid`` as the
    wire's float32 holds it (the cache key digests it; positions use it in float32 anyway)."""
    cfg = ModelConfig.from_dir(model_dir)
    out = process_video(frames, processor_configs(model_dir, cfg)[1], fps)
    return VideoInput(torch.from_numpy(out.patches), out.grid_thw,
                      float(np.float32(out.second_per_grid)), out.timestamps)


def _patches_video(cfg: ModelConfig) -> tuple[gpb.Video, VideoInput]:
    """A video sent as patches (3 temporal patches, 0.5 s each), in both forms."""
    grid = (3, 4, 4)
    rng = np.random.default_rng(7)
    patches = rng.standard_normal((math.prod(grid), cfg.vision.patch_dim)).astype(np.float32)
    return (gpb.Video(patches=patches_message(patches, grid), second_per_grid=0.5),
            VideoInput(torch.from_numpy(patches.copy()), grid, 0.5))


def _case(name: str, model_dir: Path) -> Case:
    """The request ``name`` (see :data:`CASES`) for the model in ``model_dir``."""
    clip = gpb.Video(frames=gpb.VideoFrames(frames=CLIP, fps=CLIP_FPS))
    if name == "text":
        text = "<|im_start|>user\ndescribe the weather<|im_end|>\n<|im_start|>assistant\n"
        return Case(gpb.GenerateRequest(text=text), Prompt(text=text))
    if name == "one image":
        text = "look: <|vision_start|><|image_pad|><|vision_end|> what is it?"
        return Case(gpb.GenerateRequest(text=text, images=[gpb.Image(encoded=PHOTO)]),
                    Prompt(text=text, images=[PHOTO]))
    if name == "two images":  # no placeholders: both images go first
        text = "compare the two pictures"
        photos = [PHOTO, OTHER_PHOTO]
        return Case(gpb.GenerateRequest(text=text, images=[gpb.Image(encoded=p) for p in photos]),
                    Prompt(text=text, images=photos))
    if name == "video":
        text = "what happens <|vision_start|><|video_pad|><|vision_end|> here?"
        return Case(gpb.GenerateRequest(text=text, videos=[clip]),
                    Prompt(text=text, videos=[_engine_clip(model_dir, CLIP, CLIP_FPS)]))
    if name == "video patches":
        text = "and now <|vision_start|><|video_pad|><|vision_end|>"
        video, engine_video = _patches_video(ModelConfig.from_dir(model_dir))
        return Case(gpb.GenerateRequest(text=text, videos=[video]),
                    Prompt(text=text, videos=[engine_video]))
    if name == "image and video":
        return Case(gpb.GenerateRequest(text=CHAT, images=[gpb.Image(encoded=PHOTO)],
                                        videos=[clip]),
                    Prompt(text=CHAT, images=[PHOTO],
                           videos=[_engine_clip(model_dir, CLIP, CLIP_FPS)]))
    raise AssertionError(name)


CASES = ["text", "one image", "two images", "video", "video patches", "image and video"]


def _worker_rebuilt(engine: LLMEngine, prepared: PreparedRequest) -> Request:
    """The request a decode worker builds from what the router sends (``router.service``'s
    ``WorkerRequest``, through the wire and ``decode_node.service.engine_inputs``)."""
    wreq = wpb.WorkerRequest(room=1, request_id="r", token_ids=prepared.token_ids,
                             images=prepared.images, sampling=prepared.sampling,
                             videos=prepared.videos)
    ids, images, videos, sampling = engine_inputs(wpb.WorkerRequest.FromString(
        wreq.SerializeToString()))
    return engine.new_request(ids, images, sampling, videos=videos)


def _engine_own(engine: LLMEngine, prompt: Prompt) -> Request:
    """The request the engine builds for the prompt given to it directly."""
    prepared = engine.prepare(prompt)
    return engine.new_request(prepared.token_ids, prepared.images, videos=prepared.videos)


def _assert_same_request(got: Request, want: Request) -> None:
    """Equal prompts, rope tables, deltas, visual inputs (in prompt order) and cache keys."""
    assert got.prompt_token_ids == want.prompt_token_ids
    g, w = got.payload, want.payload
    assert isinstance(g, RequestState) and isinstance(w, RequestState)
    assert (g.mrope_table is None) == (w.mrope_table is None)
    if w.mrope_table is not None:
        assert g.mrope_table is not None
        assert torch.equal(g.mrope_table, w.mrope_table)
    assert g.delta == w.delta
    assert (g.image_prefix is None) == (w.image_prefix is None)
    if w.image_prefix is not None:
        np.testing.assert_array_equal(g.image_prefix, w.image_prefix)
    assert g.vision_starts == w.vision_starts
    assert [type(x) for x in g.images] == [type(x) for x in w.images]
    for a, b in zip(g.images, w.images, strict=True):
        assert a.grid_thw == b.grid_thw
        assert torch.equal(a.patches, b.patches)
        if isinstance(a, VideoInput) and isinstance(b, VideoInput):
            assert a.second_per_grid == b.second_per_grid
    assert got.visual_keys == want.visual_keys


@pytest.mark.parametrize("name", CASES)
def test_worker_request_equals_the_engines_own(name: str, checkpoint: Path,
                                               checkpoint_engine: LLMEngine) -> None:
    prep = Preprocessor(ModelAssets.from_dir(checkpoint), 8, max_images=2,
                        video_limits=CLIP_LIMITS)
    case = _case(name, checkpoint)
    prepared = prep.prepare(case.request)
    want = _engine_own(checkpoint_engine, case.prompt)
    assert prepared.token_ids == want.prompt_token_ids
    _assert_same_request(_worker_rebuilt(checkpoint_engine, prepared), want)
    state = want.payload
    assert isinstance(state, RequestState)
    if name == "text":
        assert state.mrope_table is None
        return
    # a visual prompt: positions are not the plain 0..n-1 and the tokens past it shift
    assert state.mrope_table is not None and state.delta != 0
    cfg = prep.assets.config
    ids = prepared.token_ids
    videos = list(case.prompt.videos)
    video_runs = sum(1 for i, t in enumerate(ids) if t == cfg.video_token_id
                     and ids[i - 1] != cfg.video_token_id)
    want_runs = sum(v.grid_thw[0] for v in videos) if cfg.is_qwen3 else len(videos)
    assert video_runs == want_runs  # Qwen3: one block per temporal patch


def test_the_clip_has_timestamps_the_grid_alone_does_not_give(hf3_dir: Path) -> None:
    """The video cases above could not tell the clip's own timestamps from those derived from
    ``second_per_grid`` if both were equal: they are not, and the prompts differ by them."""
    video = _engine_clip(hf3_dir, CLIP, CLIP_FPS)
    derived = default_timestamps(video.grid_thw[0], video.second_per_grid, 2)
    assert [timestamp_text(t) for t in video.timestamps] != [timestamp_text(t) for t in derived]
