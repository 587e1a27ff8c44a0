"""The Qwen2-VL decoder and the full conditional-generation model, over flat token batches.

Tokens of all sequences in a forward are concatenated into one ``[T, hidden]`` tensor; attention
metadata (which tokens belong to which sequence, where their K/V live) comes from the attention
backend, prepared once per forward. Parameter names follow the Hugging Face layout
(``model.layers.{i}.self_attn.q_proj.weight``, ``visual.blocks.{i}...``, ``lm_head.weight``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig, TextConfig
from engine.models.layers import MropeRotary, RMSNorm, activation, apply_rotary
from engine.models.vision import Grid, VisionTower


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.num_heads, self.num_kv_heads = d, h, kv
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=True)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        layer: int,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn.forward(q, k, v, layer).reshape(t, -1))


class Mlp(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Mlp(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        layer: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Embedding, the stack of decoder layers, final norm."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2VLModel(nn.Module):
    """Vision tower + decoder + LM head. Stateless: the KV lives in the attention backend's pool."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        t = cfg.text
        self.model = TextModel(t)
        self.visual = VisionTower(cfg.vision)
        self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = MropeRotary(t.head_dim, t.rope_theta, t.mrope_section)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]``."""
        return self.model.embed_tokens(input_ids)

    def encode_images(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Image patches -> one embedding per image token ``[sum(t*h*w/m^2), hidden]``."""
        return self.visual(patches.to(self.dtype), grids).to(self.dtype)

    def forward(
        self, embeds: torch.Tensor, mrope_positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Run the decoder over ``embeds`` ``[T, hidden]`` at ``mrope_positions`` ``[3, T]``.

        Writes every token's K/V through ``attn`` and returns the final-normed hidden states
        ``[T, hidden]``.
        """
        cos, sin = self.rotary(mrope_positions, embeds.dtype)
        x = embeds
        for local, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attn, local)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab]``."""
        return self.lm_head(hidden).float()
