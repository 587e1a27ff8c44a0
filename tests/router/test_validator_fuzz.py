"""Fuzz of the router's request validator (``router.preprocess.Preprocessor.prepare``).

Contract under test: for any ``GenerateRequest`` (random input kind, token ids in and out of the
vocabulary, random images given as encoded bytes or as patches with random shapes and grids,
random sampling values including NaN, infinities and huge numbers) ``prepare`` either returns a
request whose token ids all lie in the vocabulary, whose image placeholders match its images and
whose patches match their grids, or raises ``InvalidRequestError``; no other exception escapes.
Malformed protobuf bytes fail ``GenerateRequest.FromString`` with ``DecodeError`` only.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import event, given, settings
from hypothesis import strategies as st
from PIL import Image

from engine.core.request import MAX_TEMPERATURE
from engine.errors import InvalidRequestError
from engine.multimodal.image_processor import num_image_tokens
from engine.multimodal.mrope import rope_index
from proto.pdserve.v1 import generate_pb2 as gpb
from router.preprocess import ModelAssets, PreparedRequest, Preprocessor

FUZZ = settings(max_examples=200, deadline=None)
MAX_IMAGES = 3
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
F32 = st.floats(width=32)  # NaN and infinities included; the wire carries float32


@pytest.fixture(scope="module")
def prep(tiny_dir: Path) -> Preprocessor:
    """The validator as the router builds it, over the tiny model's assets."""
    assets = ModelAssets.from_dir(tiny_dir)
    cfg = assets.config
    assert (assets.vocab_size, cfg.vision.patch_dim) == (VOCAB, PATCH_DIM)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
            cfg.video_token_id) == (IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD)
    return Preprocessor(assets, max_new_tokens_default=16, max_images=MAX_IMAGES)


# The tiny model's geometry (the fixture asserts these against its files).
VOCAB = 512
PATCH_DIM = 1176
IMAGE_PAD, VISION_START, VISION_END = 510, 508, 509
VIDEO_PAD = 511  # a video placeholder without a video is refused, like a stray image one

# ---- strategies -------------------------------------------------------------------------------


def _png(width: int, height: int, mode: str, seed: int) -> bytes:
    """A small encoded PNG of random pixels."""
    rng = np.random.default_rng(seed)
    chans = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    pixels = rng.integers(0, 256, (height, width, chans), dtype=np.uint8)
    img = Image.fromarray(pixels[..., 0] if chans == 1 else pixels, mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


PNGS = st.builds(_png, st.integers(1, 96), st.integers(1, 96),
                 st.sampled_from(["L", "RGB", "RGBA"]), st.integers(0, 2**16))


@st.composite
def encoded_images(draw: st.DrawFn) -> gpb.Image:
    """Encoded image bytes: random, a valid PNG, or a truncated / bit-flipped PNG."""
    kind = draw(st.sampled_from(["random", "png", "truncated", "flipped", "empty"]))
    if kind == "random":
        return gpb.Image(encoded=draw(st.binary(min_size=1, max_size=128)))
    if kind == "empty":
        return gpb.Image(encoded=b"")
    data = bytearray(draw(PNGS))
    if kind == "truncated":
        data = data[: draw(st.integers(1, len(data) - 1))]
    elif kind == "flipped":
        for pos in draw(st.lists(st.integers(0, len(data) * 8 - 1), min_size=1, max_size=4)):
            data[pos // 8] ^= 1 << (pos % 8)
    return gpb.Image(encoded=bytes(data))


@st.composite
def patch_images(draw: st.DrawFn) -> gpb.Image:
    """Precomputed patches with random grids, shapes, lengths and values (NaN/inf included)."""
    dims = st.sampled_from([0, 1, 2, 3, 4, 6])
    grid = [draw(st.integers(0, 2)), draw(dims), draw(dims)]
    if draw(st.booleans()):
        grid = grid[: draw(st.integers(0, 2))] + draw(st.lists(UINT32, max_size=2))
    grid_cells = grid[0] * grid[1] * grid[2] if len(grid) == 3 else 0
    n = draw(st.one_of(st.just(min(grid_cells, 2**32 - 1)), st.integers(0, 80)))
    d = draw(st.one_of(st.just(PATCH_DIM), st.integers(0, 8)))
    shape = draw(st.one_of(st.just([n, d]), st.lists(st.integers(0, 80), max_size=3)))
    if draw(st.booleans()) and n * d <= 80 * PATCH_DIM:
        fill = draw(st.one_of(st.floats(-4, 4, width=32), F32))
        data = np.full(n * d, fill, dtype="<f4").tobytes()
    else:
        data = draw(st.binary(max_size=64))
    return gpb.Image(patches=gpb.ImagePatches(data=data, shape=shape, grid_thw=grid))


@st.composite
def valid_patch_images(draw: st.DrawFn) -> gpb.Image:
    """Patches that match their grid (so that accepted requests are common)."""
    t, h, w = draw(st.sampled_from([(1, 2, 2), (1, 2, 4), (2, 4, 2), (1, 6, 2)]))
    values = draw(st.floats(-4, 4, width=32))
    data = np.full(t * h * w * PATCH_DIM, values, dtype="<f4").tobytes()
    return gpb.Image(patches=gpb.ImagePatches(data=data, shape=[t * h * w, PATCH_DIM],
                                              grid_thw=[t, h, w]))


IMAGES = st.lists(
    st.one_of(encoded_images(), patch_images(), st.just(gpb.Image()), valid_patch_images(),
              PNGS.map(lambda b: gpb.Image(encoded=b))),
    max_size=MAX_IMAGES + 1,
)
VALID_IMAGES = st.lists(st.one_of(valid_patch_images(), PNGS.map(lambda b: gpb.Image(encoded=b))),
                        max_size=MAX_IMAGES)
TOKEN = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([IMAGE_PAD, VISION_START, VISION_END]),
                  UINT32)
TEXT = st.lists(st.one_of(st.text(max_size=12), st.just("<|image_pad|>"),
                          st.just("<|vision_start|>")), max_size=6).map("".join)


@st.composite
def samplings(draw: st.DrawFn, wild: bool) -> gpb.SamplingParams:
    """Sampling values; ``wild`` spans the whole wire range (negative, NaN, inf, huge)."""

    def either(sane: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> Any:
        return st.one_of(sane, anything) if wild else sane

    def pick(sane: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> Any:
        return draw(either(sane, anything))

    msg = gpb.SamplingParams(
        temperature=pick(st.floats(0, 2, width=32), F32),
        top_p=pick(st.floats(0, 1, width=32), F32),
        top_k=pick(st.integers(0, 64), UINT32),
        max_new_tokens=pick(st.integers(0, 64), UINT32),
        stop_token_ids=draw(st.lists(either(st.integers(0, VOCAB - 1), UINT32), max_size=4)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.booleans()),
    )
    if draw(st.booleans()):
        msg.seed = pick(st.integers(0, 1000), UINT64)
    return msg


@st.composite
def requests(draw: st.DrawFn) -> gpb.GenerateRequest:
    """A random GenerateRequest (text, token ids or no input)."""
    req = gpb.GenerateRequest(request_id=draw(st.text(max_size=8)),
                              images=draw(st.one_of(IMAGES, VALID_IMAGES)))
    sampling = draw(st.sampled_from(["default", "sane", "wild"]))
    if sampling != "default":
        req.sampling.CopyFrom(draw(samplings(wild=sampling == "wild")))
    kind = draw(st.sampled_from(["text", "token_ids", "aligned", "none"]))
    if kind == "text":
        req.text = draw(TEXT)
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(TOKEN, max_size=48)))
    elif kind == "aligned":  # in-vocabulary text tokens and one placeholder per image
        ids = draw(st.lists(st.integers(0, IMAGE_PAD - 1), min_size=1, max_size=24))
        for _ in req.images:
            ids.insert(draw(st.integers(0, len(ids))), IMAGE_PAD)
        req.token_ids.ids.extend(ids)
    return req


# ---- checks -----------------------------------------------------------------------------------


def check_prepared(prep: Preprocessor, req: gpb.GenerateRequest, out: PreparedRequest) -> None:
    """Everything a worker relies on holds for an accepted request."""
    cfg = prep.assets.config
    vocab, merge = prep.assets.vocab_size, cfg.vision.spatial_merge_size
    assert out.token_ids and all(0 <= t < vocab for t in out.token_ids)
    assert len(out.images) == len(req.images) <= prep.max_images
    counts = []
    for msg in out.images:
        t, h, w = (int(x) for x in msg.grid_thw)
        assert min(t, h, w) > 0 and h % merge == 0 and w % merge == 0
        assert list(msg.shape) == [t * h * w, cfg.vision.patch_dim]
        assert len(msg.data) == t * h * w * cfg.vision.patch_dim * 4
        assert np.isfinite(np.frombuffer(msg.data, dtype="<f4")).all()
        counts.append(num_image_tokens((t, h, w), merge))
    assert sum(1 for t in out.token_ids if t == cfg.image_token_id) == sum(counts)
    s = out.sampling
    assert 1 <= s.max_new_tokens
    assert len(out.token_ids) + s.max_new_tokens <= prep.assets.max_model_len
    assert math.isfinite(s.temperature) and 0.0 <= s.temperature <= MAX_TEMPERATURE
    assert 0.0 < s.top_p <= 1.0
    assert all(0 <= t < vocab for t in s.stop_token_ids)


def check_request(prep: Preprocessor, req: gpb.GenerateRequest) -> PreparedRequest | None:
    """Run the validator: a checked prepared request, or None after InvalidRequestError."""
    try:
        out = prep.prepare(req)
    except InvalidRequestError:
        event("refused")
        return None
    event(f"accepted with {len(out.images)} images")
    check_prepared(prep, req, out)
    return out


# ---- tests ------------------------------------------------------------------------------------


@FUZZ
@given(req=requests())
def test_validator_accepts_only_well_formed_requests(prep: Preprocessor,
                                                     req: gpb.GenerateRequest) -> None:
    """Random requests: a well-formed prepared request or InvalidRequestError, nothing else."""
    check_request(prep, req)


@FUZZ
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=32), grid=st.sampled_from(
    [(1, 2, 2), (1, 4, 4), (2, 2, 4), (1, 2, 6)]), expanded=st.booleans())
def test_valid_patch_requests_are_accepted(prep: Preprocessor, ids: list[int],
                                           grid: tuple[int, int, int], expanded: bool) -> None:
    """Well-formed token-id + patches requests pass (so the fuzz above is not vacuous)."""
    count = num_image_tokens(grid, 2)
    ids = [t for t in ids if t not in (IMAGE_PAD, VIDEO_PAD)]
    ids += [IMAGE_PAD] * (count if expanded else 1)
    n = grid[0] * grid[1] * grid[2]
    patches = gpb.ImagePatches(data=np.zeros(n * PATCH_DIM, "<f4").tobytes(),
                               shape=[n, PATCH_DIM], grid_thw=list(grid))
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids), images=[gpb.Image(patches=patches)])
    out = check_request(prep, req)
    assert out is not None


@FUZZ
@given(data=st.binary(max_size=256))
def test_malformed_protobuf_bytes(prep: Preprocessor, data: bytes) -> None:
    """Arbitrary bytes: FromString raises DecodeError or yields a request the validator handles."""
    try:
        req = gpb.GenerateRequest.FromString(data)
    except DecodeError:
        return
    check_request(prep, req)


@FUZZ
@given(req=requests(), data=st.data())
def test_truncated_and_flipped_protobufs(prep: Preprocessor, req: gpb.GenerateRequest,
                                         data: st.DataObject) -> None:
    """Truncations and bit flips of valid encodings (unknown fields included) fail cleanly."""
    wire = bytearray(req.SerializeToString())
    if data.draw(st.booleans(), label="unknown field"):
        wire += bytes([0xF8, 0x07, 0x2A])  # field 127, varint 42: unknown, must be skipped
    wire = wire[: data.draw(st.integers(0, len(wire)), label="cut")]
    if wire:
        for pos in data.draw(st.lists(st.integers(0, len(wire) * 8 - 1), max_size=3)):
            wire[pos // 8] ^= 1 << (pos % 8)
    try:
        parsed = gpb.GenerateRequest.FromString(bytes(wire))
    except DecodeError:
        return
    check_request(prep, parsed)


def test_scattered_image_pads_are_refused_by_the_validator(prep: Preprocessor) -> None:
    patches = gpb.ImagePatches(data=np.zeros(16 * PATCH_DIM, "<f4").tobytes(),
                               shape=[16, PATCH_DIM], grid_thw=[1, 4, 4])  # 4 image tokens
    ids = [1, IMAGE_PAD, 2, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD]  # 4 pads, not one run
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                              images=[gpb.Image(patches=patches)])
    try:
        out = prep.prepare(req)
    except InvalidRequestError:
        return
    cfg = prep.assets.config
    rope_index(out.token_ids, [(1, 4, 4)], cfg.image_token_id, cfg.vision.spatial_merge_size)
