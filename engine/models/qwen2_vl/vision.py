"""The Qwen2-VL vision tower: patch embedding, blocks with 2-D rotary, patch merger; and the
pieces the Qwen2.5-VL tower shares (patch embedding, segment attention, merger, rotary angles).

Input: patches ``[N, C*T*P*P]`` exactly as the image or video processor produces them, and one
grid ``(t, h, w)`` per image or video (attention stays inside each frame). Output: one
embedding per merged patch ``[N / merge**2, hidden]``, in prompt order. Parameter names follow
the Hugging Face ``visual.*`` layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.models.layers import DeviceCopies, RotaryTables, activation, inverse_frequencies

Grid = tuple[int, int, int]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=k, stride=k, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = patches.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.embed_dim)


def segment_groups(lengths: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Row indices of consecutive segments of ``lengths`` rows, grouped by length: one
    ``[segments, length]`` tensor per distinct length, on ``device``."""
    starts: dict[int, list[int]] = {}
    for start, n in zip(itertools.accumulate([0, *lengths[:-1]]), lengths, strict=True):
        starts.setdefault(n, []).append(start)
    return [
        torch.tensor(s, device=device).unsqueeze(1) + torch.arange(n, device=device)
        for n, s in starts.items()
    ]


class SegmentAttention(nn.Module):
    """Bidirectional attention inside segments of rows: every segment of one length attends in
    one batched call."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=True)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)

    def forward(
        self, x: torch.Tensor, groups: Sequence[torch.Tensor], rot: RotaryTables
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, heads, D]
        q = rot.apply(q.float()).to(x.dtype)
        k = rot.apply(k.float()).to(x.dtype)
        out = torch.empty_like(q)
        for rows in groups:  # [S, L]
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [S, heads, L, D]
            out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, cfg.embed_dim)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """LayerNorm, attention within frames, LayerNorm, MLP (Qwen2-VL's ``VisionMlp`` unless
    ``mlp`` is given: the Qwen3 tower passes its own)."""

    def __init__(self, cfg: VisionConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn = SegmentAttention(cfg)
        self.mlp = VisionMlp(cfg) if mlp is None else mlp

    def forward(
        self, x: torch.Tensor, frames: Sequence[torch.Tensor], rot: RotaryTables
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), frames, rot)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each run of ``m*m`` rows ``[N, embed_dim]`` becomes one ``[N/m^2, hidden]`` row, after the
    norm ``ln_q`` (Qwen2-VL's LayerNorm by default; Qwen2.5-VL passes an RMSNorm)."""

    def __init__(self, cfg: VisionConfig, ln_q: nn.Module | None = None) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = ln_q if ln_q is not None else nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    """Patches of several images in, merged patch embeddings out."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        # [D/4], float32
        self.inv_freq = DeviceCopies(inverse_frequencies(cfg.head_dim // 2, cfg.rope_theta))

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """``patches`` ``[N, C*T*P*P]``, ``grids`` one ``(t, h, w)`` per image -> ``[N/m^2, H]``."""
        x = self.patch_embed(patches)  # [N, embed_dim]
        rot = self._rotary(grids)
        # full attention inside each frame of each image or video
        frames = segment_groups([h * w for t, h, w in grids for _ in range(t)], x.device)
        for blk in self.blocks:
            x = blk(x, frames, rot)
        return self.merger(x)

    def _rotary(self, grids: Sequence[Grid]) -> RotaryTables:
        """2-D rotary tables of the patches, computed on the weights' device."""
        dev = self.patch_embed.proj.weight.device
        emb = rotary_angles(grids, self.cfg.spatial_merge_size, self.inv_freq.on(dev))
        return RotaryTables(emb.cos(), emb.sin())


def rotary_angles(grids: Sequence[Grid], merge: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """The 2-D rotary angles ``[N, D]`` of every patch, in merge-block order, on the device of
    ``inv_freq`` ``[D/4]``: the (row, col) of each patch times the frequencies, laid out
    ``[row freqs, col freqs]`` twice (shared by the Qwen2-VL and Qwen2.5-VL towers)."""
    m, dev = merge, inv_freq.device
    rows = []
    for t, h, w in grids:
        hpos = torch.arange(h, device=dev).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        wpos = torch.arange(w, device=dev).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        hw = torch.stack([hpos.transpose(1, 2).flatten(), wpos.transpose(1, 2).flatten()], dim=-1)
        rows.append(hw.repeat(t, 1))
    pos = torch.cat(rows).float()  # [N, 2]
    freqs = (pos.unsqueeze(-1) * inv_freq).flatten(1)  # [N, D/2]: h, then w
    return torch.cat((freqs, freqs), dim=-1)
