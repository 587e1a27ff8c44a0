"""Content digests of a request's images and videos, for the prefix cache's block keys.

Two prompts with the same token ids (placeholders included) but different images must never
share KV, so every visual input adds a digest of its content to the key of the block holding its
first placeholder token (``engine/core/prefix_cache.py`` chains it into every later block). The
digest covers what the KV depends on: the kind, the grid, a video's seconds per temporal patch
(its mrope positions) and the patch values (their bytes, so equal floats hash equal and any
change in any patch changes it).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from engine.multimodal.inputs import ImageInput, RequestState, VideoInput

# marks where a resumed prompt's output begins when that output holds vision placeholder ids
# (those are text there: see ``engine.multimodal.inputs.build_state``)
RESUMED_TEXT = b"pdserve:resumed-text"


def visual_digest(item: ImageInput | VideoInput) -> bytes:
    """A 16-byte digest of one image's or video's content (kind, grid, timing, patches)."""
    kind = b"video" if isinstance(item, VideoInput) else b"image"
    seconds = item.second_per_grid if isinstance(item, VideoInput) else 0.0
    h = hashlib.blake2b(kind, digest_size=16)
    h.update(struct.pack("<3qd", *item.grid_thw, seconds))
    patches = item.patches.detach().to("cpu", torch.float32).contiguous()
    h.update(patches.numpy().tobytes())
    return h.digest()


def visual_keys(
    state: RequestState, token_ids: Sequence[int], vision_ids: tuple[int, int], resumed: int
) -> tuple[tuple[int, bytes], ...]:
    """``(first placeholder index, digest)`` of each visual input of a prompt, in prompt order
    (``Request.visual_keys``); plus a :data:`RESUMED_TEXT` marker at the resumed output's start
    when that output holds a vision placeholder id (``vision_ids``: image and video token ids),
    so such a prompt never shares a block with one that reads those ids as vision tokens."""
    keys = [(start, visual_digest(item))
            for start, item in zip(state.vision_starts, state.images, strict=True)]
    if resumed:
        start = len(token_ids) - resumed
        if any(t in vision_ids for t in token_ids[start:]):
            keys.append((start, RESUMED_TEXT))
    return tuple(keys)
