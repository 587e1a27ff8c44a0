"""The Qwen3-VL vision tower, also Qwen3.5's (which has no DeepStack mergers): a patch embedding
with bias, a learned square position table resampled to each grid, LayerNorm blocks with 2-D
rotary and a two-layer MLP, the patch merger, and one DeepStack merger per layer of
``deepstack_visual_indexes``.

Input: patches ``[N, C*T*P*P]`` exactly as the image or video processor produces them (merge
blocks of ``m*m`` consecutive patches), and one grid ``(t, h, w)`` per image or video (attention
stays inside each frame). Output: the merged embeddings ``[N / m**2, hidden]`` in prompt order,
and the DeepStack features, one ``[N / m**2, hidden]`` tensor per DeepStack layer, in block order.
Parameter names follow the Hugging Face ``visual.*`` layout.

Position table: ``pos_embed`` holds ``side * side`` rows (``side = isqrt(num_position_embeddings)``)
for a ``side x side`` grid. Each patch at (row, col) of an ``h x w`` frame reads it bilinearly
with aligned corners: row ``r`` maps to ``r * (side - 1) / max(h - 1, 1)`` of the table (the
same for columns), the four taps' weights are the products of the per-axis weights, computed in
float32 and summed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.models.layers import DeviceCopies, RotaryTables, activation, inverse_frequencies
from engine.models.qwen2_vl.vision import Grid, VisionBlock, rotary_angles, segment_groups

_NORM_EPS = 1e-6


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (``proj``, with bias). Its stride equals its kernel, so it is one
    matrix product: on accelerators it runs as that GEMM (cuDNN has been reported to pick very
    slow kernels for this Conv3d in bfloat16), on the CPU as the Conv3d itself, bit-equal to
    transformers."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=k, stride=k, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[N, C*T*P*P]`` -> ``[N, embed_dim]``."""
        if patches.device.type != "cpu":
            return self.as_matmul(patches)
        c = self.cfg
        x = patches.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.embed_dim)

    def as_matmul(self, patches: torch.Tensor) -> torch.Tensor:
        """The same product as one ``F.linear`` (equal to the Conv3d up to summation order)."""
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


def _axis_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table taps ``[size, 2]`` (long) of every position along an axis of ``size``
    patches and their bilinear weights ``[size, 2]`` (float32), corners aligned."""
    src = torch.arange(size, dtype=torch.float32, device="cpu") * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2, device="cpu")
    taps = (floor.long().unsqueeze(1) + offsets).clamp(0, side - 1)
    weights = (1 - (src.unsqueeze(1) - floor.unsqueeze(1) - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(
    grids: Sequence[Grid], side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the ``side x side`` position table that every patch of ``grids`` reads, in
    merge-block order, on the host: ``taps`` ``[N, 4]`` (long) and their weights ``[N, 4]``
    (float32); every frame of a video reads the same rows."""
    all_taps: list[torch.Tensor] = []
    all_weights: list[torch.Tensor] = []
    for t, h, w in grids:
        row_taps, row_weights = _axis_taps(h, side)  # [h, 2]
        col_taps, col_weights = _axis_taps(w, side)  # [w, 2]
        taps = row_taps[:, None, :, None] * side + col_taps[None, :, None, :]  # [h, w, 2, 2]
        weights = row_weights[:, None, :, None] * col_weights[None, :, None, :]
        # (row, col) -> (block row, block col, row in block, col in block)
        block = (h // merge, merge, w // merge, merge, 4)
        for table, out in ((taps, all_taps), (weights, all_weights)):
            out.append(table.reshape(block).transpose(1, 2).reshape(h * w, 4).repeat(t, 1))
    return torch.cat(all_taps), torch.cat(all_weights)


class Mlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        assert cfg.intermediate_size is not None  # checked by the config
        self.linear_fc1 = nn.Linear(cfg.embed_dim, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.embed_dim)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """Each run of ``m*m`` rows ``[N, embed_dim]`` becomes one ``[N/m^2, hidden]`` row. The
    LayerNorm comes before the rows are joined (over each row: the final merger) or after
    (``postshuffle``, over the joined ``m*m*embed_dim`` row: the DeepStack mergers)."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.embed_dim, eps=_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            joined = self.norm(x.view(-1, self.width))
        else:
            joined = self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(joined)))


class Qwen3VisionTower(nn.Module):
    """Patches of several images or videos in; merged embeddings and DeepStack features out."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.side = math.isqrt(cfg.num_position_embeddings)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim)
        self.blocks = nn.ModuleList([VisionBlock(cfg, Mlp(cfg)) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, postshuffle=False)
        indexes = cfg.deepstack_visual_indexes
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(cfg, postshuffle=True) for _ in indexes])
        # block -> its DeepStack merger (the first one named, were a block named twice)
        self.deepstack_of = {layer: indexes.index(layer) for layer in indexes}
        # [D/4], float32
        self.inv_freq = DeviceCopies(inverse_frequencies(cfg.head_dim // 2, cfg.rope_theta))

    def forward(
        self, patches: torch.Tensor, grids: Sequence[Grid]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``patches`` ``[N, C*T*P*P]``, ``grids`` one ``(t, h, w)`` each -> the merged
        embeddings ``[N/m^2, H]`` and one ``[N/m^2, H]`` DeepStack feature per DeepStack block,
        in block order (an empty list without DeepStack)."""
        merge = self.cfg.spatial_merge_size
        dev = self.pos_embed.weight.device
        x = self.patch_embed(patches)  # [N, embed_dim]
        x = x + self._positions(grids, dev).to(x.dtype)
        emb = rotary_angles(grids, merge, self.inv_freq.on(dev))
        rot = RotaryTables(emb.cos(), emb.sin())
        # full attention inside each frame of each image or video
        frames = segment_groups([h * w for t, h, w in grids for _ in range(t)], dev)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, frames, rot)
            j = self.deepstack_of.get(i)
            if j is not None:
                deepstack.append(self.deepstack_merger_list[j](x))
        return self.merger(x), deepstack

    def _positions(self, grids: Sequence[Grid], dev: torch.device) -> torch.Tensor:
        """The interpolated position embedding ``[N, embed_dim]`` (float32) of every patch: the
        four taps' weighted rows added one tap at a time, in tap order (on the CPU the order, and
        so the float32 result, of transformers' sum over the taps), without an
        ``[N, 4, embed_dim]`` temporary."""
        taps, weights = position_taps(grids, self.side, self.cfg.spatial_merge_size)
        taps, weights = taps.to(dev), weights.to(dev)
        pos = self.pos_embed(taps[:, 0]) * weights[:, :1]  # float32 weights: a float32 sum
        for k in range(1, taps.shape[1]):
            pos = pos + self.pos_embed(taps[:, k]) * weights[:, k : k + 1]
        return pos
