"""The Qwen3-VL vision tower (and Qwen3.5's, without DeepStack) against transformers' own
``Qwen3VLVisionModel`` / ``Qwen3_5VisionModel`` (float32, CPU): merged embeddings and DeepStack
features for images, several images at once, videos, grids larger and smaller than the position
table; the position taps against ``F.interpolate``; bfloat16 runs."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.models.qwen3_vl.vision import Qwen3VisionTower, position_taps

Grid = tuple[int, int, int]
PATCH_DIM = 3 * 2 * 16 * 16
SIDE = 6  # the position table is SIDE x SIDE
HF_VISION: dict[str, Any] = {
    "depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
    "out_hidden_size": 48, "patch_size": 16, "num_position_embeddings": SIDE * SIDE,
}
OURS = VisionConfig(
    depth=3, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=0.0, in_channels=3,
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, hidden_act="gelu_pytorch_tanh",
    rope_theta=10000.0, intermediate_size=64, num_position_embeddings=SIDE * SIDE,
    deepstack_visual_indexes=(0, 2),
)
# (1, 4, 6): one image smaller than the table; (2, 6, 4): a two-frame video; (1, 12, 10): larger
# than the table (upsampled); (1, 6, 6): the table's own size; (1, 2, 14): one merge block high
GRIDS = [[(1, 4, 6)], [(1, 4, 6), (1, 12, 10)], [(2, 6, 4)], [(1, 12, 10)], [(1, 6, 6)],
         [(1, 2, 2), (2, 4, 4), (1, 2, 14)]]


def patches(grids: list[Grid], seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def randomised(model: nn.Module, seed: int) -> nn.Module:
    """``model`` with every parameter moved well away from its initial value (norms included),
    so a wrong norm, bias or table row shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def ours_of(hf: nn.Module, cfg: VisionConfig) -> Qwen3VisionTower:
    tower = Qwen3VisionTower(cfg).eval()
    tower.load_state_dict(hf.state_dict())  # strict: the checkpoint's names and shapes
    return tower


@pytest.fixture(scope="module")
def hf_vl() -> nn.Module:
    from transformers import Qwen3VLVisionConfig, Qwen3VLVisionModel

    torch.manual_seed(0)
    cfg = Qwen3VLVisionConfig(**HF_VISION, deepstack_visual_indexes=[0, 2])
    return randomised(Qwen3VLVisionModel(cfg), seed=1)


@pytest.fixture(scope="module")
def hf_35() -> nn.Module:
    from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel

    torch.manual_seed(0)
    return randomised(Qwen3_5VisionModel(Qwen3_5VisionConfig(**HF_VISION)), seed=2)


# float32 on both sides with the same operations in the same order: on the CPU the outputs are
# bit-equal (outputs are of size 10-40); the tolerance leaves room for another kernel's
# summation order only
ATOL = 1e-5


@pytest.mark.parametrize("grids", GRIDS, ids=str)
def test_qwen3_vl_tower_equals_transformers(grids: list[Grid], hf_vl: nn.Module) -> None:
    x = patches(grids, seed=len(grids))
    with torch.no_grad():
        want = hf_vl(x, torch.tensor(grids))
        merged, deepstack = ours_of(hf_vl, OURS)(x, grids)
    torch.testing.assert_close(merged, want.pooler_output, atol=ATOL, rtol=ATOL)
    assert len(deepstack) == 2
    for got, expected in zip(deepstack, want.deepstack_features, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("grids", GRIDS[:4], ids=str)
def test_qwen3_5_tower_equals_transformers(grids: list[Grid], hf_35: nn.Module) -> None:
    cfg = dataclasses.replace(OURS, deepstack_visual_indexes=())
    x = patches(grids, seed=10 + len(grids))
    with torch.no_grad():
        want = hf_35(x, torch.tensor(grids)).pooler_output
        merged, deepstack = ours_of(hf_35, cfg)(x, grids)
    torch.testing.assert_close(merged, want, atol=ATOL, rtol=ATOL)
    assert deepstack == []


def test_deepstack_features_come_in_block_order_as_transformers_gives_them() -> None:
    """Indexes listed out of order (2, 0): the features still come block by block, block 0's
    from merger 1 (transformers' order, the one its decoder adds to layers 0, 1, ...)."""
    from transformers import Qwen3VLVisionConfig, Qwen3VLVisionModel

    torch.manual_seed(0)
    hf = randomised(Qwen3VLVisionModel(
        Qwen3VLVisionConfig(**HF_VISION, deepstack_visual_indexes=[2, 0])), seed=3)
    grids = [(1, 4, 6)]
    x = patches(grids, seed=4)
    with torch.no_grad():
        want = hf(x, torch.tensor(grids)).deepstack_features
        _, got = ours_of(hf, dataclasses.replace(OURS, deepstack_visual_indexes=(2, 0)))(x, grids)
    assert len(got) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize(("h", "w"), [(4, 6), (12, 10), (6, 6), (2, 14)])
def test_position_taps_resample_the_table_as_bilinear_interpolate_with_aligned_corners(
    h: int, w: int
) -> None:
    """An oracle independent of transformers: ``F.interpolate`` of the table to ``h x w``,
    read in merge-block order, repeated for each of the 2 frames."""
    table = torch.randn(SIDE * SIDE, 5, generator=torch.Generator().manual_seed(h * w))
    taps, weights = position_taps([(2, h, w)], SIDE, merge=2)
    got = (table[taps] * weights.unsqueeze(-1)).sum(1)  # [2*h*w, 5]
    grid = table.t().reshape(1, 5, SIDE, SIDE)
    full = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [5, h, w]
    blocks = full.reshape(5, h // 2, 2, w // 2, 2).permute(1, 3, 2, 4, 0).reshape(h * w, 5)
    torch.testing.assert_close(got, blocks.repeat(2, 1), atol=1e-6, rtol=1e-6)


def test_the_accelerators_patch_matmul_equals_the_conv(hf_vl: nn.Module) -> None:
    embed = ours_of(hf_vl, OURS).patch_embed
    x = patches([(1, 4, 6)], seed=5)
    with torch.no_grad():
        torch.testing.assert_close(embed.as_matmul(x), embed(x), atol=1e-4, rtol=1e-5)


def test_bfloat16_runs_finite_and_close_to_transformers_in_bfloat16(hf_vl: nn.Module) -> None:
    """transformers' tower cast to bfloat16 keeps its rotary frequencies in float32, as
    ``from_pretrained(dtype=torch.bfloat16)`` leaves them (a plain ``.to`` would round them)."""
    tower = ours_of(hf_vl, OURS).to(torch.bfloat16)
    hf = copy.deepcopy(hf_vl)
    inv_freq = hf.get_buffer("rotary_pos_emb.inv_freq").clone()
    hf.to(torch.bfloat16).get_submodule("rotary_pos_emb").register_buffer(
        "inv_freq", inv_freq, persistent=False)
    grids = [(1, 4, 6), (2, 12, 10)]
    x = patches(grids, seed=6)  # float32 in: the towers cast
    with torch.no_grad():
        merged, deepstack = tower(x, grids)
        want = hf(x, torch.tensor(grids))
    n = sum(t * h * w for t, h, w in grids) // 4
    assert len(deepstack) == 2
    for out, ref in zip((merged, *deepstack), (want.pooler_output, *want.deepstack_features),
                        strict=True):
        assert out.shape == (n, 48) and out.dtype == torch.bfloat16
        assert torch.isfinite(out).all()
        # the same operations in the same dtypes (bit-equal on this CPU): a bfloat16 step at most
        torch.testing.assert_close(out, ref, atol=0.25, rtol=2**-7)
