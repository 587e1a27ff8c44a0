"""mrope: the prompt's 3-D rope index equals transformers' ``get_rope_index`` (images and videos,
Qwen2-VL and Qwen2.5-VL); positions past the prompt are ``n + delta`` on all three axes;
image/video/grid mismatches are clear request errors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.multimodal.mrope import Grid, mrope_from_1d, num_image_tokens, rope_index
from tests.conftest import HF_SPECIAL, HF_TEXT, HF_VISION

IMG = HF_SPECIAL["image_token_id"]
VS = HF_SPECIAL["vision_start_token_id"]
VE = HF_SPECIAL["vision_end_token_id"]
MERGE = HF_VISION["spatial_merge_size"]
TEXT_IDS = 370  # text tokens are drawn from [0, TEXT_IDS): no special token among them

# A layout is a list of segments: ("text", [ids]) or ("image", grid). An image segment becomes
# exactly num_image_tokens(grid) image tokens; separators are ordinary segments.
Segment = tuple[str, object]


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201 - transformers model
    from transformers import Qwen2VLConfig, Qwen2VLModel

    cfg = Qwen2VLConfig(text_config=dict(HF_TEXT), vision_config=dict(HF_VISION), **HF_SPECIAL)
    torch.manual_seed(0)
    return Qwen2VLModel(cfg).eval()


def text(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TEXT_IDS, (n,), generator=gen).tolist()


def build(layout: Sequence[Segment]) -> tuple[list[int], list[Grid], list[tuple[int, int]]]:
    """Token ids, image grids in order, and each image's ``(start, end)`` token span."""
    ids: list[int] = []
    grids: list[Grid] = []
    spans: list[tuple[int, int]] = []
    for kind, value in layout:
        if kind == "text":
            assert isinstance(value, list)
            ids += value
        else:
            grid = tuple(value)  # type: ignore[arg-type]
            n = num_image_tokens(grid, MERGE)  # type: ignore[arg-type]
            spans.append((len(ids), len(ids) + n))
            ids += [IMG] * n
            grids.append(grid)  # type: ignore[arg-type]
    return ids, grids, spans


def reference(
    hf_model, ids: list[int], grids: list[Grid], spans: list[tuple[int, int]]  # noqa: ANN001
) -> tuple[torch.Tensor, int]:
    """transformers' positions ``[3, L]`` and delta for one prompt.

    transformers groups consecutive tokens of one modality type, so two images with no token
    between them would read as one. To give it the same image boundaries as ours, images that
    touch the previous one are typed as "video" (type 2): its position rule is the same call.
    """
    ids_t = torch.tensor([ids])
    types = torch.zeros_like(ids_t)
    image_grids: list[Grid] = []
    video_grids: list[Grid] = []
    prev_end, prev_type = -1, 2
    for (start, end), grid in zip(spans, grids, strict=True):
        kind = (3 - prev_type) if start == prev_end else 1
        types[0, start:end] = kind
        (image_grids if kind == 1 else video_grids).append(grid)
        prev_end, prev_type = end, kind
    kwargs = {}
    if image_grids:
        kwargs["image_grid_thw"] = torch.tensor(image_grids)
    if video_grids:
        kwargs["video_grid_thw"] = torch.tensor(video_grids)
    with torch.no_grad():
        pos, delta = hf_model.get_rope_index(ids_t, types, **kwargs)
    return pos[:, 0], int(delta.reshape(-1)[0])


def check_against_transformers(hf_model, layout: Sequence[Segment]) -> None:  # noqa: ANN001
    ids, grids, spans = build(layout)
    ours, delta = rope_index(ids, grids, IMG, MERGE)
    want, want_delta = reference(hf_model, ids, grids, spans)
    assert ours.dtype == np.int64
    assert tuple(ours.shape) == (3, len(ids))
    assert torch.equal(torch.from_numpy(ours), want), f"positions differ for layout {layout}"
    assert delta == want_delta


def T(n: int, seed: int = 0) -> Segment:  # noqa: N802 - short layout helpers
    return ("text", text(n, seed))


def I(t: int, h: int, w: int) -> Segment:  # noqa: N802,E743
    return ("image", (t, h, w))


SEP: Segment = ("text", [VE, VS])
FIXED: dict[str, list[Segment]] = {
    "text_only": [T(17)],
    "one_image": [T(3), ("text", [VS]), I(1, 4, 6), ("text", [VE]), T(5, 1)],
    "two_images_of_different_sizes": [
        T(4), ("text", [VS]), I(1, 8, 4), ("text", [VE]), T(2, 1), ("text", [VS]), I(1, 2, 2),
        ("text", [VE]), T(6, 2)],
    "image_at_start": [I(1, 6, 4), ("text", [VE]), T(7)],
    "image_at_end": [T(9), ("text", [VS]), I(1, 4, 10)],
    "only_an_image": [I(1, 4, 4)],
    "adjacent_images_separated_by_end_start": [
        T(2), ("text", [VS]), I(1, 4, 6), SEP, I(1, 6, 2), ("text", [VE]), T(3, 1)],
    "back_to_back_images_no_separator": [T(2), I(1, 4, 6), I(1, 2, 8), T(3, 1)],
    "three_back_to_back_images": [I(1, 2, 2), I(1, 4, 4), I(1, 6, 2)],
    "temporal_grid_of_two": [T(3), ("text", [VS]), I(2, 4, 4), ("text", [VE]), T(4, 1)],
    "tall_and_wide": [T(1), I(1, 10, 2), T(1, 1), I(1, 2, 10), T(1, 2)],
}


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_layouts_match_transformers(name: str, hf_model) -> None:  # noqa: ANN001
    check_against_transformers(hf_model, FIXED[name])


def test_back_to_back_images_have_their_own_blocks() -> None:
    """Two images with no token between them: the second starts where the first's text
    position ends (p + max(h, w)), not inside the first block."""
    ids, grids, _ = build([I(1, 4, 4), I(1, 2, 2)])
    pos, delta = rope_index(ids, grids, IMG, MERGE)
    # first image: 2x2 merged grid at p=0; second: 1x1 at p=2
    assert pos.tolist() == [[0, 0, 0, 0, 2], [0, 0, 1, 1, 2], [0, 1, 0, 1, 2]]
    assert delta == 3 - 5


layouts = st.lists(
    st.tuples(
        st.integers(0, 20),
        st.one_of(st.none(), st.tuples(st.integers(1, 5), st.integers(1, 5))),
    ),
    min_size=1,
    max_size=5,
).filter(lambda segs: sum(1 for _, im in segs if im is not None) <= 4)


@settings(max_examples=60, deadline=None)
@given(segments=layouts, seed=st.integers(0, 2**16))
def test_random_layouts_match_transformers(
    segments: list[tuple[int, tuple[int, int] | None]], seed: int, hf_model  # noqa: ANN001
) -> None:
    """Random text runs (0..20 tokens) with 0..4 images of grid (1, 2a, 2b) between them."""
    layout: list[Segment] = []
    for i, (n, image) in enumerate(segments):
        if n:
            layout.append(T(n, seed + i))
        if image is not None:
            layout.append(I(1, 2 * image[0], 2 * image[1]))
    ids, _, _ = build(layout)
    if not ids:
        return  # an empty prompt has no rope index (the engine refuses it earlier)
    check_against_transformers(hf_model, layout)


def test_worked_example() -> None:
    a, b = 7, 9
    ids = [a, VS, *[IMG] * 6, VE, b]
    pos, delta = rope_index(ids, [(1, 4, 6)], IMG, 2)
    assert delta == -3
    assert pos[0].tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]
    assert pos[1].tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]
    assert pos[2].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]


def test_text_only_is_arange_with_zero_delta() -> None:
    ids = text(11)
    pos, delta = rope_index(ids, [], IMG, MERGE)
    assert delta == 0
    assert np.array_equal(pos, np.broadcast_to(np.arange(11), (3, 11)))


@pytest.mark.parametrize("delta", [0, -3, 5])
def test_mrope_from_1d_int_delta(delta: int) -> None:
    pos1d = torch.tensor([10, 11, 12, 40, 3], dtype=torch.int64)
    out = mrope_from_1d(pos1d, delta)
    assert tuple(out.shape) == (3, pos1d.shape[0])
    for row in out:
        assert torch.equal(row, pos1d + delta)
    if delta == 0:
        assert torch.equal(out[0], pos1d)


def test_mrope_from_1d_per_row_deltas() -> None:
    pos1d = torch.tensor([10, 11, 12, 40, 3], dtype=torch.int64)  # [T]: two requests' tokens
    deltas = torch.tensor([-3, -3, -3, 0, 7], dtype=torch.int64)  # [T]
    out = mrope_from_1d(pos1d, deltas)
    assert tuple(out.shape) == (3, 5)
    want = torch.tensor([7, 8, 9, 40, 10])
    for row in out:
        assert torch.equal(row, want)
    zero = mrope_from_1d(pos1d, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(zero, pos1d.expand(3, -1))


def test_mrope_from_1d_empty_forward() -> None:
    out = mrope_from_1d(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert tuple(out.shape) == (3, 0)


def test_decode_positions_continue_the_prompt() -> None:
    """Token n past the prompt sits at n + delta: the first one is max(prompt positions) + 1."""
    ids = [5, VS, *[IMG] * 6, VE, 6]
    pos, delta = rope_index(ids, [(1, 4, 6)], IMG, 2)
    after = mrope_from_1d(torch.arange(len(ids), len(ids) + 3), delta)
    assert after[:, 0].tolist() == [int(pos.max()) + 1] * 3
    assert after[0].tolist() == [7, 8, 9]


MISMATCHES: dict[str, tuple[list[int], list[Grid], str]] = {
    "more_images_than_runs": ([1, VS, *[IMG] * 4, VE, 2], [(1, 4, 4), (1, 2, 2)], "images"),
    "images_but_no_image_tokens": ([1, 2, 3], [(1, 2, 2)], "images"),
    "fewer_images_than_runs": (
        [1, VS, *[IMG] * 4, VE, VS, *[IMG] * 4, VE], [(1, 4, 4)], "image tokens"),
    "image_tokens_but_no_images": ([1, IMG, 2], [], "image tokens"),
    "run_shorter_than_grid": ([1, VS, *[IMG] * 3, VE, 2], [(1, 4, 4)], "image tokens"),
    "run_shorter_at_end_of_prompt": ([1, *[IMG] * 3], [(1, 4, 4)], "image tokens"),
    "run_longer_than_grid": ([1, VS, *[IMG] * 5, VE], [(1, 4, 4)], "image tokens"),
    "split_run_for_one_image": ([1, IMG, IMG, 2, IMG, IMG], [(1, 4, 4)], "image tokens"),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatches_raise_invalid_request(name: str) -> None:
    ids, grids, word = MISMATCHES[name]
    with pytest.raises(InvalidRequestError, match=word):
        rope_index(ids, grids, IMG, MERGE)


# ---- videos (Qwen2-VL and Qwen2.5-VL) ---------------------------------------------------------
# A mixed layout has ("image", grid) and ("video", (grid, second_per_grid)) segments. The oracle
# is transformers' unbound ``get_rope_index`` on a stand-in holding only a config; it groups
# consecutive tokens of one type, so two blocks of one kind are always separated by text here.

VID = HF_SPECIAL["video_token_id"]


def hf_rope_oracle(tokens_per_second: float | None):  # noqa: ANN201 - transformers stand-in
    """An object whose ``get_rope_index`` is transformers' for Qwen2-VL (``None``) or
    Qwen2.5-VL (with ``tokens_per_second``)."""
    from types import SimpleNamespace

    from transformers import Qwen2_5_VLModel, Qwen2VLModel

    cls = Qwen2VLModel if tokens_per_second is None else Qwen2_5_VLModel
    vision = SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=tokens_per_second)

    class StandIn:
        get_rope_index = cls.get_rope_index
        get_vision_position_ids = cls.get_vision_position_ids
        config = SimpleNamespace(vision_config=vision)

    return StandIn()


def V(t: int, h: int, w: int, seconds: float = 1.0) -> Segment:  # noqa: N802
    return ("video", ((t, h, w), seconds))


def check_mixed(layout: Sequence[Segment], tokens_per_second: float | None) -> None:
    ids: list[int] = []
    types: list[int] = []
    images: list[Grid] = []
    videos: list[Grid] = []
    seconds: list[float] = []
    for kind, value in layout:
        if kind == "text":
            assert isinstance(value, list)
            ids += value
            types += [0] * len(value)
            continue
        assert not types or types[-1] != (1 if kind == "image" else 2), "same kinds touch"
        grid, secs = (value, 1.0) if kind == "image" else value  # type: ignore[misc]
        n = num_image_tokens(grid, MERGE)  # type: ignore[arg-type]
        ids += [IMG if kind == "image" else VID] * n
        types += [1 if kind == "image" else 2] * n
        (images if kind == "image" else videos).append(grid)  # type: ignore[arg-type]
        if kind == "video":
            seconds.append(secs)  # type: ignore[arg-type]
    ours, delta = rope_index(ids, images, IMG, MERGE, video_grids=videos, video_token_id=VID,
                             video_seconds=seconds, tokens_per_second=tokens_per_second)
    kwargs: dict[str, torch.Tensor] = {}
    if images:
        kwargs["image_grid_thw"] = torch.tensor(images)
    if videos:
        kwargs["video_grid_thw"] = torch.tensor(videos)
        if tokens_per_second is not None:
            kwargs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
    want, want_delta = hf_rope_oracle(tokens_per_second).get_rope_index(
        torch.tensor([ids]), torch.tensor([types]), **kwargs)
    assert torch.equal(torch.from_numpy(ours), want[:, 0]), f"positions differ for {layout}"
    assert delta == int(want_delta.reshape(-1)[0])


MIXED: dict[str, list[Segment]] = {
    "one_video_t2": [T(3), ("text", [VS]), V(2, 4, 4, 0.5), ("text", [VE]), T(5, 1)],
    "one_video_t3_long_temporal": [T(2), ("text", [VS]), V(3, 2, 2, 1.3), ("text", [VE]), T(4)],
    "image_video_image": [
        T(2), ("text", [VS]), I(1, 4, 6), ("text", [VE, VS]), V(3, 4, 4, 2 / 3),
        ("text", [VE, VS]), I(1, 2, 8), ("text", [VE]), T(3, 1)],
    "video_then_image_touching": [V(2, 2, 6, 0.7), I(1, 4, 4), T(3)],
    "two_videos": [V(2, 4, 2, 0.25), ("text", [VE, VS]), V(3, 2, 2, 1.75), T(2, 2)],
    "video_at_end": [T(4), ("text", [VS]), V(4, 2, 4, 0.1)],
}


@pytest.mark.parametrize("tokens_per_second", [None, 2.0, 25.0], ids=["qwen2", "tps2", "tps25"])
@pytest.mark.parametrize("name", list(MIXED))
def test_video_layouts_match_transformers(name: str, tokens_per_second: float | None) -> None:
    check_mixed(MIXED[name], tokens_per_second)


def test_qwen2_video_temporal_positions_step_by_one_and_text_continues_at_max_hw() -> None:
    """A t=3 video of merged 1x1 frames at p=1: temporal 1, 2, 3; the text after it continues
    at p + max(h, w) = 2, inside the video's temporal range (transformers' rule)."""
    ids = [5, VID, VID, VID, 6]
    pos, delta = rope_index(ids, [], IMG, MERGE, video_grids=[(3, 2, 2)], video_token_id=VID)
    assert pos.tolist() == [[0, 1, 2, 3, 2], [0, 1, 1, 1, 2], [0, 1, 1, 1, 2]]
    assert delta == 4 - 5


media = st.one_of(
    st.none(),
    st.tuples(st.just("image"), st.integers(1, 2), st.integers(1, 4), st.integers(1, 4)),
    st.tuples(st.just("video"), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3),
              st.floats(0.0625, 4.0, width=32)),
)


@settings(max_examples=80, deadline=None)
@given(
    segments=st.lists(st.tuples(st.integers(0, 8), media), min_size=1, max_size=5),
    tokens_per_second=st.sampled_from([None, 1.0, 2.0, 4.0, 25.0, 2.5]),
    seed=st.integers(0, 2**16),
)
def test_random_video_layouts_match_transformers(
    segments: list[tuple[int, tuple[object, ...] | None]],
    tokens_per_second: float | None,
    seed: int,
) -> None:
    """Random text runs with images (t in 1..2) and videos (t in 1..4, fractional seconds per
    grid) between them, for Qwen2-VL and Qwen2.5-VL."""
    layout: list[Segment] = []
    last = ""
    for i, (n, item) in enumerate(segments):
        if n:
            layout.append(T(n, seed + i))
            last = "text"
        if item is None:
            continue
        if item[0] == last:  # transformers would read two touching blocks of a kind as one
            layout.append(SEP)
        grid = (int(item[1]), 2 * int(item[2]), 2 * int(item[3]))  # type: ignore[call-overload]
        if item[0] == "image":
            layout.append(("image", grid))
        else:
            layout.append(("video", (grid, float(item[4]))))  # type: ignore[arg-type]
        last = str(item[0])
    if not layout:
        return  # an empty prompt has no rope index
    check_mixed(layout, tokens_per_second)


VIDEO_MISMATCHES: dict[str, tuple[list[int], list[Grid], list[Grid], str]] = {
    "video_tokens_but_no_videos": ([1, VID, 2], [], [], "video tokens"),
    "videos_but_no_video_tokens": ([1, IMG, 2], [(1, 2, 2)], [(2, 2, 2)], "videos"),
    "video_run_shorter_than_grid": ([1, VID, VID, 2], [], [(3, 2, 2)], "video tokens"),
    "image_grid_for_video_tokens": ([1, *[VID] * 4], [(1, 4, 4)], [], "video tokens"),
    "video_run_interrupted_by_image": ([VID, IMG, VID], [(1, 2, 2)], [(2, 2, 2)], "video"),
}


@pytest.mark.parametrize("name", list(VIDEO_MISMATCHES))
def test_video_mismatches_raise_invalid_request(name: str) -> None:
    ids, images, videos, word = VIDEO_MISMATCHES[name]
    with pytest.raises(InvalidRequestError, match=word):
        rope_index(ids, images, IMG, MERGE, video_grids=videos, video_token_id=VID)


def test_seconds_must_match_the_videos() -> None:
    with pytest.raises(InvalidRequestError, match="seconds"):
        rope_index([VID], [], IMG, MERGE, video_grids=[(1, 2, 2)], video_token_id=VID,
                   video_seconds=[1.0, 2.0], tokens_per_second=2.0)
