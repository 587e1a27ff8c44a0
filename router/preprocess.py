"""Turning a public ``GenerateRequest`` into what workers consume: token ids with image and
video placeholders expanded, image and video patches, and complete sampling values.

Everything a user can get wrong is checked here and raised as :class:`InvalidRequestError`
(the service maps it to ``INVALID_ARGUMENT``), so workers only ever see well-formed rooms.
Work is CPU-bound (tokenizing, decoding and resizing images): call :meth:`Preprocessor.prepare`
off the event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.config import ModelConfig
from engine.core.request import SamplingParams
from engine.errors import InvalidRequestError
from engine.multimodal.image_processor import (
    ImageProcessorConfig,
    expand_image_placeholders,
    num_image_tokens,
    process_image,
    validate_patches,
)
from engine.multimodal.prompt_layout import (
    expand_prompt,
    expand_videos,
    processor_configs,
    prompt_rope_index,
)
from engine.multimodal.video_processor import (
    VideoProcessorConfig,
    process_video,
    validate_video_patches,
)
from engine.multimodal.video_timestamps import default_timestamps
from engine.sampling.generation_config import GenerationDefaults
from engine.text.chat_template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from proto.convert import (
    ConversionError,
    patches_array,
    patches_message,
    sampling_kwargs,
    video_message,
)
from proto.pdserve.v1 import generate_pb2 as gpb
from router.config import VideoLimits


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: ``token_ids`` (placeholders expanded), one ``ImagePatches`` per
    image in prompt order, and sampling with every default filled in; ``videos``: one
    patches-source ``Video`` per video in prompt order, ``second_per_grid`` resolved (never 0)."""

    token_ids: list[int]
    images: list[gpb.ImagePatches]
    sampling: gpb.SamplingParams
    videos: list[gpb.Video] = field(default_factory=list)


@dataclass(frozen=True)
class ModelAssets:
    """What the router knows about the served model (no weights)."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    image_config: ImageProcessorConfig
    chat_template: ChatTemplate = field(default_factory=ChatTemplate.builtin)  # the door's
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # sampling
    video_config: VideoProcessorConfig = field(default_factory=VideoProcessorConfig)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelAssets:
        """Load ``config.json``, ``tokenizer.json`` (optional), the image and video processor
        settings (as the engine reads them: ``engine.multimodal.prompt_layout``) and the chat
        template; raises ``engine.errors.ConfigError`` on an unusable directory."""
        config = ModelConfig.from_dir(model_dir)
        image, video = processor_configs(model_dir, config)
        return cls(config, Tokenizer.from_dir(model_dir), image,
                   chat_template=ChatTemplate.from_dir(model_dir),
                   generation=GenerationDefaults.from_dir(model_dir), video_config=video)

    @property
    def max_model_len(self) -> int:
        return self.config.text.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.text.vocab_size


class Preprocessor:
    """Validates and tokenizes requests for one model; thread-safe (holds no mutable state)."""

    def __init__(self, assets: ModelAssets, max_new_tokens_default: int, max_images: int,
                 video_limits: VideoLimits | None = None) -> None:
        video_limits = video_limits or VideoLimits()
        self.assets = assets
        self.max_new_tokens_default = max_new_tokens_default
        self.max_images = max_images
        self.max_videos = video_limits.max_videos
        self.video_config = replace(assets.video_config, max_frames=video_limits.max_frames,
                                    max_patch_bytes=video_limits.max_patch_bytes)

    def prepare(self, req: gpb.GenerateRequest) -> PreparedRequest:
        """Validate ``req`` and build its worker form; raises InvalidRequestError."""
        sampling = self._sampling(req.sampling)
        if len(req.images) > self.max_images:
            raise InvalidRequestError(
                f"{len(req.images)} images is more than the limit of {self.max_images}")
        images = [self._image(i, im) for i, im in enumerate(req.images)]
        grids = [_grid(msg) for msg in images]
        merge = self.assets.config.vision.spatial_merge_size
        counts = [num_image_tokens(g, merge) for g in grids]
        if len(req.videos) > self.max_videos:
            raise InvalidRequestError(
                f"{len(req.videos)} videos is more than the limit of {self.max_videos}")
        prepared = [self._video(i, v) for i, v in enumerate(req.videos)]
        videos = [v for v, _ in prepared]
        stamps = [t for _, t in prepared]
        video_grids = [_grid(v.patches) for v in videos]
        kind = req.WhichOneof("input")
        if kind == "text":
            ids = self._encode_text(req.text, grids, video_grids, stamps)
        elif kind == "token_ids":
            ids = self._check_ids(list(req.token_ids.ids), counts, video_grids, stamps)
        else:
            raise InvalidRequestError("the request has no input: give text or token_ids")
        prompt_rope_index(ids, self.assets.config, grids, video_grids,  # one run per visual
                          [v.second_per_grid for v in videos])
        total = len(ids) + sampling.max_new_tokens
        if total > self.assets.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                f"{total} exceeds the model's max length {self.assets.max_model_len}")
        return PreparedRequest(ids, images, sampling, videos)

    # ---- pieces ------------------------------------------------------------------------------

    def _sampling(self, msg: gpb.SamplingParams) -> gpb.SamplingParams:
        """``msg`` with every unset field filled: the checkpoint's generation_config.json
        default, else the server's; then validated."""
        out = gpb.SamplingParams()
        out.CopyFrom(msg)
        defaults = self.assets.generation
        for name in _DEFAULTED:
            value = getattr(defaults, name)
            if value is not None and not out.HasField(name):
                setattr(out, name, value)
        if not out.max_new_tokens:
            out.max_new_tokens = defaults.max_new_tokens or self.max_new_tokens_default
        values = sampling_kwargs(out, self.max_new_tokens_default)
        SamplingParams(**values).validate(self.assets.vocab_size)
        if out.stop and self.assets.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer: this model has none")
        limit = self.assets.max_model_len
        if values["max_new_tokens"] > limit:
            raise InvalidRequestError(
                f"max_new_tokens {values['max_new_tokens']} is over the limit of {limit}")
        out.top_p = values["top_p"]
        return out

    def _image(self, index: int, image: gpb.Image) -> gpb.ImagePatches:
        cfg = self.assets.image_config
        try:
            source = image.WhichOneof("source")
            if source == "encoded":
                processed = process_image(image.encoded, cfg)
                return patches_message(processed.patches, processed.grid_thw)
            if source == "patches":
                array, grid = patches_array(image.patches)
                validate_patches(array, grid, cfg)
                if array.shape[1] != self.assets.config.vision.patch_dim:
                    raise InvalidRequestError(
                        f"patch width {array.shape[1]} does not match the model's "
                        f"{self.assets.config.vision.patch_dim}")
                return image.patches
            raise InvalidRequestError("the image is empty: set encoded or patches")
        except (InvalidRequestError, ConversionError) as exc:
            raise InvalidRequestError(f"image {index}: {exc}") from exc

    def _video(self, index: int, video: gpb.Video) -> tuple[gpb.Video, tuple[float, ...]]:
        """The worker form of one video: patches with ``second_per_grid`` resolved (the
        request's, else ``temporal_patch_size / fps`` for frames, 1.0 for patches); and, for
        the Qwen3 family, its seconds per temporal patch (the prompt shows them)."""
        cfg = self.video_config
        try:
            seconds = float(video.second_per_grid)
            if seconds != 0 and not (math.isfinite(seconds) and seconds > 0):
                raise InvalidRequestError(
                    f"second_per_grid must be positive and finite (0: derived), got {seconds}")
            source = video.WhichOneof("source")
            stamps: tuple[float, ...] = ()
            if source == "frames":
                processed = process_video(list(video.frames.frames), cfg, video.frames.fps)
                array, grid = processed.patches, processed.grid_thw
                seconds = seconds or processed.second_per_grid
                stamps = processed.timestamps
            elif source == "patches":
                array, grid = patches_array(video.patches)
                seconds = seconds or 1.0
                validate_video_patches(array, grid, seconds, cfg)
            else:
                raise InvalidRequestError("the video is empty: set frames or patches")
            if array.shape[1] != self.assets.config.vision.patch_dim:
                raise InvalidRequestError(
                    f"patch width {array.shape[1]} does not match the model's "
                    f"{self.assets.config.vision.patch_dim}")
            if self.assets.config.is_qwen3 and not stamps:  # as LLMEngine derives them
                stamps = tuple(default_timestamps(
                    grid[0], seconds, self.assets.config.vision.temporal_patch_size))
            return video_message(array, grid, seconds), stamps
        except (InvalidRequestError, ConversionError) as exc:
            raise InvalidRequestError(f"video {index}: {exc}") from exc

    def _encode_text(self, text: str, grids: list[tuple[int, int, int]],
                     video_grids: list[tuple[int, int, int]],
                     stamps: list[tuple[float, ...]]) -> list[int]:
        """The engine's rule (``engine.multimodal.prompt_layout.expand_prompt``): without
        ``<|image_pad|>`` in the text, one ``<|vision_start|><|image_pad|><|vision_end|>``
        block per image goes first; likewise ``<|video_pad|>`` blocks for videos, after the
        images'; a Qwen3 video becomes a block per temporal patch after its timestamp."""
        tok = self.assets.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer.json: send token_ids instead")
        if not text:
            raise InvalidRequestError("the prompt text is empty")
        ids = expand_prompt(tok.encode(text), self.assets.config, grids, video_grids, stamps,
                            tok.encode)
        if not ids:
            raise InvalidRequestError("the prompt text encodes to no tokens")
        return ids

    def _check_ids(self, ids: list[int], counts: list[int],
                   video_grids: list[tuple[int, int, int]],
                   stamps: list[tuple[float, ...]]) -> list[int]:
        """Token-id prompts: ids must be in the vocabulary; image (video) placeholders are either
        already expanded (one run of ``count`` pads per image; a Qwen3 video's frame blocks with
        their timestamps) or one pad per image (video)."""
        if not ids:
            raise InvalidRequestError("the prompt token_ids are empty")
        vocab = self.assets.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {vocab})")
        cfg = self.assets.config
        ids = _expand_ids(ids, cfg.image_token_id, counts, "image")
        merge = cfg.vision.spatial_merge_size
        expanded = sum(num_image_tokens(g, merge) for g in video_grids)
        pads = sum(1 for t in ids if t == cfg.video_token_id)
        if pads == expanded:
            return ids
        if pads != len(video_grids):
            raise InvalidRequestError(
                f"prompt has {pads} video placeholder tokens but {len(video_grids)} videos need "
                f"{len(video_grids)} (one each) or {expanded} (expanded)")
        tok = self.assets.tokenizer
        if cfg.is_qwen3 and tok is None:
            raise InvalidRequestError("a Qwen3 video placeholder becomes timestamped frames, "
                                      "which needs the model's tokenizer.json: send the "
                                      "expanded prompt instead")
        return expand_videos(ids, cfg, video_grids, stamps,
                             tok.encode if tok is not None else None)


# optional message fields a checkpoint default fills when the request leaves them unset
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _expand_ids(ids: list[int], pad: int, counts: list[int], kind: str) -> list[int]:
    """``ids`` with each ``kind`` placeholder expanded: as they are when already expanded (a
    run of ``count`` pads each), expanded when one pad each; anything else is refused."""
    pads = sum(1 for t in ids if t == pad)
    if pads == sum(counts):
        return ids
    if pads == len(counts):
        return expand_image_placeholders(ids, pad, counts)
    raise InvalidRequestError(
        f"prompt has {pads} {kind} placeholder tokens but {len(counts)} {kind}s need "
        f"{len(counts)} (one each) or {sum(counts)} (expanded)")


def _grid(msg: gpb.ImagePatches) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in msg.grid_thw)
    return t, h, w
