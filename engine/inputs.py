"""Turning a user's prompt (token ids and images) into what the model runner consumes.

:class:`RequestState` is the engine's per-request payload (``Request.payload``): the images'
patches and grids, the prompt's 3-D rope table and mrope delta, the vision embeddings while the
prompt is being prefilled, and the request's random generator.

Devices: patches and the rope table stay on the host (the model copies patches to its device when
it encodes them; rope table columns are copied into each forward's positions); the vision
embeddings and the generator live on the engine's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.mrope import Grid, num_image_tokens, rope_index


@dataclass(frozen=True)
class ImageInput:
    """One image as the vision tower takes it: patches ``[t*h*w, C*T*P*P]`` and its grid."""

    patches: torch.Tensor
    grid_thw: Grid


def image_from_array(patches: np.ndarray, grid_thw: Grid) -> ImageInput:
    """An :class:`ImageInput` owning a float32 copy of ``patches``."""
    return ImageInput(torch.from_numpy(np.array(patches, dtype=np.float32)), grid_thw)


@dataclass(eq=False)
class RequestState:
    """Engine-side data of one request (the scheduler never reads it)."""

    images: list[ImageInput]
    mrope_table: torch.Tensor | None  # [3, L] prompt positions; None for text-only prompts
    delta: int  # mrope delta: tokens past the prompt sit at n + delta
    image_prefix: np.ndarray | None  # [L + 1] image tokens in prompt[:i]
    generator: torch.Generator | None = None
    image_embeds: torch.Tensor | None = field(default=None, repr=False)  # [n_img_tokens, H]


def build_state(
    token_ids: Sequence[int], images: Sequence[ImageInput], cfg: ModelConfig
) -> RequestState:
    """Validate a prompt against ``cfg`` and precompute its rope table.

    Raises :class:`InvalidRequestError` for an empty prompt, ids outside the vocabulary, or image
    tokens that do not match the images' grids.
    """
    if len(token_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    ids = np.asarray(token_ids, dtype=np.int64)
    vocab = cfg.text.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {vocab})")
    merge = cfg.vision.spatial_merge_size
    for i, image in enumerate(images):
        _check_image(i, image, cfg)
    has_image_tokens = bool((ids == cfg.image_token_id).any())
    if not images and not has_image_tokens:
        return RequestState(images=[], mrope_table=None, delta=0, image_prefix=None)
    table, delta = rope_index(ids.tolist(), [im.grid_thw for im in images], cfg.image_token_id,
                              merge)
    prefix = np.concatenate(([0], np.cumsum(ids == cfg.image_token_id)))
    return RequestState(images=list(images), mrope_table=table, delta=delta, image_prefix=prefix)


def _check_image(i: int, image: ImageInput, cfg: ModelConfig) -> None:
    v = cfg.vision
    t, h, w = image.grid_thw
    m = v.spatial_merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise InvalidRequestError(
            f"image {i}: grid {image.grid_thw} must be positive with h and w multiples of {m}"
        )
    shape = (t * h * w, v.patch_dim)
    if tuple(image.patches.shape) != shape:
        raise InvalidRequestError(
            f"image {i}: patches have shape {tuple(image.patches.shape)}, grid {image.grid_thw} "
            f"needs {shape}"
        )
    if num_image_tokens(image.grid_thw, m) == 0:
        raise InvalidRequestError(f"image {i}: grid {image.grid_thw} has no tokens")
