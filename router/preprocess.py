"""Turning a public ``GenerateRequest`` into what workers consume: token ids with image
placeholders expanded, image patches, and complete sampling values.

Everything a user can get wrong is checked here and raised as :class:`InvalidRequestError`
(the service maps it to ``INVALID_ARGUMENT``), so workers only ever see well-formed rooms.
Work is CPU-bound (tokenizing, decoding and resizing images): call :meth:`Preprocessor.prepare`
off the event loop.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.image_processor import (
    ImageProcessorConfig,
    expand_image_placeholders,
    num_image_tokens,
    process_image,
    validate_patches,
)
from engine.mrope import rope_index
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from proto.convert import ConversionError, patches_array, patches_message, sampling_kwargs
from proto.pdserve.v1 import generate_pb2 as gpb


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: ``token_ids`` (placeholders expanded), one ``ImagePatches`` per
    image in prompt order, and sampling with every default filled in."""

    token_ids: list[int]
    images: list[gpb.ImagePatches]
    sampling: gpb.SamplingParams


@dataclass(frozen=True)
class ModelAssets:
    """What the router knows about the served model (no weights)."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    image_config: ImageProcessorConfig

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelAssets:
        """Load ``config.json``, ``tokenizer.json`` (optional) and the image processor settings;
        raises ``engine.errors.ConfigError`` on an unusable directory."""
        return cls(ModelConfig.from_dir(model_dir), Tokenizer.from_dir(model_dir),
                   ImageProcessorConfig.from_dir(model_dir))

    @property
    def max_model_len(self) -> int:
        return self.config.text.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.text.vocab_size


class Preprocessor:
    """Validates and tokenizes requests for one model; thread-safe (holds no mutable state)."""

    def __init__(self, assets: ModelAssets, max_new_tokens_default: int, max_images: int) -> None:
        self.assets = assets
        self.max_new_tokens_default = max_new_tokens_default
        self.max_images = max_images

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
        kind = req.WhichOneof("input")
        if kind == "text":
            ids = self._encode_text(req.text, counts)
        elif kind == "token_ids":
            ids = self._check_ids(list(req.token_ids.ids), counts)
        else:
            raise InvalidRequestError("the request has no input: give text or token_ids")
        rope_index(ids, grids, self.assets.config.image_token_id, merge)  # one run per image
        total = len(ids) + sampling.max_new_tokens
        if total > self.assets.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                f"{total} exceeds the model's max length {self.assets.max_model_len}")
        return PreparedRequest(ids, images, sampling)

    # ---- pieces ------------------------------------------------------------------------------

    def _sampling(self, msg: gpb.SamplingParams) -> gpb.SamplingParams:
        values = sampling_kwargs(msg, self.max_new_tokens_default)
        SamplingParams(**values).validate(self.assets.vocab_size)
        limit = self.assets.max_model_len
        if values["max_new_tokens"] > limit:
            raise InvalidRequestError(
                f"max_new_tokens {values['max_new_tokens']} is over the limit of {limit}")
        out = gpb.SamplingParams()
        out.CopyFrom(msg)
        out.max_new_tokens = values["max_new_tokens"]
        out.top_p = values["top_p"]
        return out

    def _image(self, index: int, image: gpb.Image) -> gpb.ImagePatches:
        cfg = self.assets.image_config
        try:
            source = image.WhichOneof("source")
            if source == "encoded":
                processed = process_image(image.encoded, cfg)
                return patches_message(processed.patches.numpy(), processed.grid_thw)
            if source == "patches":
                array, grid = patches_array(image.patches)
                with warnings.catch_warnings():  # a read-only view of the message: only read
                    warnings.simplefilter("ignore", UserWarning)
                    patches = torch.from_numpy(array)
                validate_patches(patches, grid, cfg)
                if array.shape[1] != self.assets.config.vision.patch_dim:
                    raise InvalidRequestError(
                        f"patch width {array.shape[1]} does not match the model's "
                        f"{self.assets.config.vision.patch_dim}")
                return image.patches
            raise InvalidRequestError("the image is empty: set encoded or patches")
        except (InvalidRequestError, ConversionError) as exc:
            raise InvalidRequestError(f"image {index}: {exc}") from exc

    def _encode_text(self, text: str, counts: list[int]) -> list[int]:
        """Same rule as the engine: without ``<|image_pad|>`` in the text, one
        ``<|vision_start|><|image_pad|><|vision_end|>`` block per image goes first."""
        tok = self.assets.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer.json: send token_ids instead")
        if not text:
            raise InvalidRequestError("the prompt text is empty")
        cfg = self.assets.config
        ids = tok.encode(text)
        if counts and cfg.image_token_id not in ids:
            block = [cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id]
            ids = block * len(counts) + ids
        ids = expand_image_placeholders(ids, cfg.image_token_id, counts)
        if not ids:
            raise InvalidRequestError("the prompt text encodes to no tokens")
        return ids

    def _check_ids(self, ids: list[int], counts: list[int]) -> list[int]:
        """Token-id prompts: ids must be in the vocabulary; image placeholders are either
        already expanded (one run of ``count`` pads per image) or one pad per image."""
        if not ids:
            raise InvalidRequestError("the prompt token_ids are empty")
        vocab = self.assets.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {vocab})")
        pad = self.assets.config.image_token_id
        pads = sum(1 for t in ids if t == pad)
        if pads == sum(counts):
            return ids
        if pads == len(counts):
            return expand_image_placeholders(ids, pad, counts)
        raise InvalidRequestError(
            f"prompt has {pads} image placeholder tokens but {len(counts)} images need "
            f"{len(counts)} (one each) or {sum(counts)} (expanded)")


def _grid(msg: gpb.ImagePatches) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in msg.grid_thw)
    return t, h, w
