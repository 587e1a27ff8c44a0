"""The Qwen2.5-VL vision tower: patch embedding, RMSNorm blocks with a gated MLP and 2-D rotary,
window attention in most blocks and whole-frame attention in ``fullatt_block_indexes``, and an
RMSNorm patch merger.

Input and output are those of :class:`engine.models.qwen2_vl.vision.VisionTower`: patches
``[N, C*T*P*P]`` as the image processor produces them (merge blocks of ``m*m`` consecutive patches),
one grid ``(t, h, w)`` per image or video; out come ``[N / m**2, hidden]`` merged embeddings in
prompt order. Parameter names follow the Hugging Face ``visual.*`` layout.

Windows: each frame's grid of merged patches is cut into squares of ``cfg.window_merged``
merged patches a side, row-major, the last row and column of squares cut short. The tower
permutes the merge blocks into window order (windows of frame 0, then frame 1, ...; row-major
inside a window) once after the patch embedding, so every window and every frame is a run of
consecutive rows, and puts the merged outputs back in prompt order at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.config import VisionConfig
from engine.models.layers import (
    DeviceCopies,
    RMSNorm,
    RotaryTables,
    activation,
    inverse_frequencies,
)
from engine.models.qwen2_vl.vision import (
    Grid,
    PatchEmbed,
    PatchMerger,
    SegmentAttention,
    rotary_angles,
    segment_groups,
)

_NORM_EPS = 1e-6


def window_order(grids: Sequence[Grid], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of ``grids`` in window order, on the host.

    Returns ``order`` ``[sum(t*h*w) / m^2]`` (position ``k`` of the window order holds merge
    block ``order[k]`` of the prompt order) and the length of every window in merge blocks, in
    that order (none is empty).
    """
    orders, lengths, base = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        across = -(-cols // side)
        per_frame = -(-rows // side) * across
        win = (torch.arange(rows).view(rows, 1) // side) * across + torch.arange(cols) // side
        key = (torch.arange(t).view(t, 1, 1) * per_frame + win).flatten()  # [t*rows*cols]
        orders.append(torch.argsort(key, stable=True) + base)  # stable: row-major in a window
        lengths.extend(torch.bincount(key, minlength=t * per_frame).tolist())
        base += t * rows * cols
    return torch.cat(orders), lengths


class GatedMlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        assert cfg.intermediate_size is not None  # checked by the config
        self.gate_proj = nn.Linear(cfg.embed_dim, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.embed_dim, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.embed_dim)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.embed_dim, _NORM_EPS)
        self.norm2 = RMSNorm(cfg.embed_dim, _NORM_EPS)
        self.attn = SegmentAttention(cfg)
        self.mlp = GatedMlp(cfg)

    def forward(
        self, x: torch.Tensor, groups: Sequence[torch.Tensor], rot: RotaryTables
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), groups, rot)
        return x + self.mlp(self.norm2(x))


class Qwen25VisionTower(nn.Module):
    """Patches of several images or videos in, merged patch embeddings out (prompt order)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.full_blocks = frozenset(cfg.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, RMSNorm(cfg.embed_dim, _NORM_EPS))
        # [D/4], float32
        self.inv_freq = DeviceCopies(inverse_frequencies(cfg.head_dim // 2, cfg.rope_theta))

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """``patches`` ``[N, C*T*P*P]``, ``grids`` one ``(t, h, w)`` each -> ``[N/m^2, H]``."""
        unit = self.cfg.spatial_merge_size**2
        dev = self.patch_embed.proj.weight.device
        blocks, window_lengths = window_order(grids, self.cfg.spatial_merge_size,
                                              self.cfg.window_merged)
        blocks = blocks.to(dev)
        rows = (blocks.unsqueeze(1) * unit + torch.arange(unit, device=dev)).flatten()  # [N]
        x = self.patch_embed(patches)[rows]  # [N, embed_dim], window order
        emb = rotary_angles(grids, self.cfg.spatial_merge_size, self.inv_freq.on(dev))[rows]
        rot = RotaryTables(emb.cos(), emb.sin())
        windows = segment_groups([n * unit for n in window_lengths], dev)
        frames = segment_groups([h * w for t, h, w in grids for _ in range(t)], dev)
        for i, blk in enumerate(self.blocks):
            x = blk(x, frames if i in self.full_blocks else windows, rot)
        merged = self.merger(x)  # [N/m^2, H], window order
        out = torch.empty_like(merged)
        out[blocks] = merged
        return out
