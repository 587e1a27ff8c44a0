"""The Qwen2-VL decoder and the full conditional-generation model (Qwen2-VL and Qwen2.5-VL),
over flat token batches.

Tokens of all sequences in a forward are concatenated into one ``[T, hidden]`` tensor; attention
metadata (which tokens belong to which sequence, where their K/V live) comes from the attention
backend, prepared once per forward. Parameter names follow the Hugging Face layout
(``model.layers.{i}.self_attn.q_proj.weight``, ``visual.blocks.{i}...``, ``lm_head.weight``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig, TextConfig
from engine.models.layers import MropeRotary, RMSNorm, RotaryTables, activation
from engine.models.linear import PreparedLinear, prepare_linears
from engine.models.qwen2_vl.vision import Grid, VisionTower
from engine.models.qwen2_vl.vision_qwen2_5 import Qwen25VisionTower
from engine.models.step_extras import NO_EXTRAS, StepExtras, VisualEmbeds
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TextShard


class Attention(nn.Module):
    """Self-attention over this rank's heads (``shard``): q/k/v are column-parallel (this rank's
    heads only), ``o_proj`` row-parallel, its partial sums all-reduced over ``tp``.

    ``in_features`` is the width q/k/v read (the hidden size unless given: an EAGLE-3 draft
    layer's attention reads ``2 * hidden``)."""

    def __init__(self, cfg: TextConfig, shard: TextShard, tp: TPGroup,
                 in_features: int | None = None) -> None:
        super().__init__()
        d, h, kv = cfg.head_dim, shard.num_heads, shard.num_kv_heads
        self.head_dim, self.num_heads, self.num_kv_heads = d, h, kv
        width = cfg.hidden_size if in_features is None else in_features
        self.q_proj = nn.Linear(width, h * d, bias=True)
        self.k_proj = nn.Linear(width, kv * d, bias=True)
        self.v_proj = nn.Linear(width, kv * d, bias=True)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.tp = tp
        self.qkv: PreparedLinear | None = None  # set by fuse()
        self.o: PreparedLinear | None = None

    def fuse(self) -> None:
        """Prepare q/k/v as one linear (one matmul instead of three) and ``o_proj``
        (:func:`prepare_linears`); a second call keeps the first preparation."""
        if self.qkv is not None:
            return
        self.qkv, self.o = prepare_linears(((self.q_proj, self.k_proj, self.v_proj),
                                                 (self.o_proj,)))

    def forward(
        self, x: torch.Tensor, rot: RotaryTables, attn: AttentionBackend, layer: int
    ) -> torch.Tensor:
        assert self.qkv is not None and self.o is not None, "fuse() the model first"
        t, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x).view(t, h + 2 * kv, d)
        qk = rot.apply(qkv[:, : h + kv])  # q and k heads rotated together
        out = attn.forward(qk[:, :h], qk[:, h:], qkv[:, h + kv :], layer)
        return self.tp.all_reduce(self.o(out.reshape(t, h * d)))


# A prefill chunk of thousands of tokens goes through the MLP a few hundred rows at a time: the
# gate/up product of 256 rows (10 MB in float32 at Qwen2-0.5B's width) stays in the cache for
# the activation and the down projection, where a 4,096-row one (160 MB) makes three more trips
# through memory. Measured on the 2-core EPYC over Qwen2-0.5B's MLP (docs/performance.md):
# 4,096 rows 181 -> 209 GFLOP/s in float32, 360 -> 403 in bfloat16; at 1,024 rows 198 -> 214
# in float32, the same in bfloat16. An accelerator runs the whole product (its caches are not
# what limits it)
MLP_CHUNK_ROWS = 256
MLP_WHOLE_ROWS = 512  # up to this many rows the MLP runs whole


class Mlp(nn.Module):
    """The gated MLP over this rank's columns (``shard``): gate/up column-parallel, ``down_proj``
    row-parallel, its partial sums all-reduced over ``tp``."""

    def __init__(self, cfg: TextConfig, shard: TextShard, tp: TPGroup) -> None:
        super().__init__()
        inter = shard.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)
        self.tp = tp
        self.gate_up: PreparedLinear | None = None  # set by fuse()
        self.down: PreparedLinear | None = None

    def fuse(self) -> None:
        """Prepare gate and up as one linear, and ``down_proj`` (see :meth:`Attention.fuse`)."""
        if self.gate_up is not None:
            return
        self.gate_up, self.down = prepare_linears(((self.gate_proj, self.up_proj),
                                                        (self.down_proj,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; on a CPU, more than :data:`MLP_WHOLE_ROWS` rows
        go through in chunks of :data:`MLP_CHUNK_ROWS` (a row's result does not depend on the
        chunks but for the products' rounding: bit for bit the same on this project's CPU)."""
        assert self.gate_up is not None and self.down is not None, "fuse() the model first"
        if x.shape[0] <= MLP_WHOLE_ROWS or x.device.type != "cpu":  # accelerators: one product
            return self.tp.all_reduce(self._rows(x))
        out = x.new_empty(x.shape[0], self.down.out_features)
        for rows, part in zip(out.split(MLP_CHUNK_ROWS), x.split(MLP_CHUNK_ROWS), strict=True):
            rows.copy_(self._rows(part))
        return self.tp.all_reduce(out)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial MLP output of the rows ``x`` (before the all-reduce)."""
        assert self.gate_up is not None and self.down is not None
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """One decoder layer, split over ``tp``'s ranks (whole in the group of one).

    ``input_norm=False`` leaves out the norm before attention (an identity, no weight): the
    original EAGLE draft layer's shape, whose input is already the output of its ``fc``."""

    def __init__(self, cfg: TextConfig, tp: TPGroup = SINGLE, *, input_norm: bool = True) -> None:
        super().__init__()
        shard = TextShard.of(cfg, tp.rank, tp.size)
        self.input_layernorm: RMSNorm | nn.Identity = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity())
        self.self_attn = Attention(cfg, shard, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Mlp(cfg, shard, tp)

    def forward(
        self, x: torch.Tensor, rot: RotaryTables, attn: AttentionBackend, layer: int
    ) -> torch.Tensor:
        # .forward() directly: the hot path skips nn.Module's hook machinery
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rot, attn, layer)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class TextModel(nn.Module):
    """Embedding, the stack of decoder layers, final norm (each family builds its own layers
    and norm; the names are the checkpoints' for all)."""

    def __init__(self, cfg: TextConfig, layers: Sequence[nn.Module], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class Qwen2VLModel(nn.Module):
    """Vision tower + decoder + LM head. Stateless: the KV lives in the attention backend's pool.

    Qwen2-VL and Qwen2.5-VL share the decoder; ``cfg.model_type`` picks the vision tower. The
    Qwen3 families subclass this (:mod:`engine.models.qwen3_vl.model`): they build their own
    layers and tower (:meth:`build_text`, :meth:`build_visual`) and add to a layer's output
    (:meth:`run_layer`); every method here runs them unchanged.

    With a ``tp`` group of several ranks the decoder layers hold this rank's share
    (:mod:`engine.parallel.shard`) and every rank runs :meth:`forward` over the same inputs
    together; the embedding, the vision tower and the LM head are rank 0's alone (the other ranks
    are built without them), and every rank's forward returns the hidden states of the whole model
    (the all-reduced sums)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        t = cfg.text
        self.model = self.build_text(t, tp)
        self.visual = self.build_visual(cfg)
        self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = MropeRotary(t.rotary_dim, t.rope_theta, t.mrope_section,
                                  t.mrope_interleaved)
        self.head: PreparedLinear | None = None  # the LM head, prepared by fuse()

    def build_text(self, cfg: TextConfig, tp: TPGroup) -> TextModel:
        """The decoder stack (embedding, layers, final norm)."""
        return TextModel(cfg, [DecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers)],
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def build_visual(self, cfg: ModelConfig) -> nn.Module:
        """The vision tower ``cfg.model_type`` names."""
        if cfg.model_type == "qwen2_5_vl":
            return Qwen25VisionTower(cfg.vision)
        return VisionTower(cfg.vision)

    def pool_index(self, layer: int, layers: range) -> int:
        """Where global decoder layer ``layer`` keeps its context in an engine holding
        ``layers``: its index in the KV pool (layers numbered from ``layers.start``)."""
        return layer - layers.start

    def run_layer(self, layer: int, x: torch.Tensor, rot: RotaryTables,
                  attn: AttentionBackend, index: int, extras: StepExtras) -> torch.Tensor:
        """Global decoder layer ``layer`` over ``x``, its context at pool index ``index``."""
        return self.model.layers[layer].forward(x, rot, attn, index)

    def fuse(self) -> None:
        """Fuse and prepare projections for inference (:func:`prepare_linears`) and the LM
        head; call once, after the weights are loaded and placed."""
        for layer in self.model.layers:
            if isinstance(layer, DecoderLayer):  # not a layer a pipeline stage dropped
                layer.self_attn.fuse()
                layer.mlp.fuse()
        self.fuse_head()

    def fuse_head(self) -> None:
        """Prepare the LM head (a packed copy beside the plain weight, which stays: it may be
        the embedding's, and drafts and training scripts read it)."""
        head = getattr(self, "lm_head", None)  # a TP rank past 0 holds no head
        if head is not None and self.head is None:
            self.head = PreparedLinear(head.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live (every tensor a forward makes is put there too)."""
        return self.model.norm.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]``."""
        return F.embedding(input_ids, self.model.embed_tokens.weight)

    def encode_images(self, patches: torch.Tensor, grids: Sequence[Grid]) -> VisualEmbeds:
        """Image patches (on any device; host ones are copied to the model's) -> one embedding
        per image token ``[sum(t*h*w/m^2), hidden]``, on the model's device, and (Qwen3-VL)
        the DeepStack features of those tokens."""
        patches = patches.to(device=self.device, dtype=self.dtype)
        return VisualEmbeds(self.visual(patches, grids).to(self.dtype))

    def forward(
        self, embeds: torch.Tensor, mrope_positions: torch.Tensor, attn: AttentionBackend,
        extras: StepExtras = NO_EXTRAS,
    ) -> torch.Tensor:
        """Run the decoder over ``embeds`` ``[T, hidden]`` at ``mrope_positions`` ``[3, T]``.

        Writes every token's K/V through ``attn`` (and a hybrid model's states through
        ``extras.states``) and returns the final-normed hidden states ``[T, hidden]``.
        """
        return self.forward_aux(embeds, mrope_positions, attn, (), extras)[0]

    def forward_aux(
        self, embeds: torch.Tensor, mrope_positions: torch.Tensor, attn: AttentionBackend,
        aux_layers: Sequence[int], extras: StepExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, also returning the outputs of decoder layers ``aux_layers`` (the
        residual stream after each, before the final norm; what an EAGLE-3 draft fuses),
        concatenated in the order given: ``([T, hidden], [T, len(aux_layers) * hidden])``."""
        layers = range(len(self.model.layers))
        x, outs = self.forward_layers_aux(embeds, mrope_positions, attn, layers, final_norm=True,
                                          aux_layers=aux_layers, extras=extras)
        aux = torch.cat([outs[i] for i in aux_layers], dim=-1) if aux_layers else x[:, :0]
        return x, aux

    def forward_layers(
        self, hidden: torch.Tensor, mrope_positions: torch.Tensor, attn: AttentionBackend,
        layers: range, *, final_norm: bool,
    ) -> torch.Tensor:
        """Run global decoder layers ``layers`` (a contiguous range, a pipeline stage's share)
        over ``hidden`` ``[T, hidden]`` at ``mrope_positions`` ``[3, T]``.

        The attention pool holds exactly these layers, numbered locally from 0 (global layer
        ``layers.start + i`` is pool layer ``i``). Returns ``[T, hidden]``: the final-normed
        states when ``final_norm`` (the last stage), else the raw residual stream for the next
        stage. Over all layers with ``final_norm`` this equals :meth:`forward`.
        """
        return self.forward_layers_aux(hidden, mrope_positions, attn, layers,
                                       final_norm=final_norm)[0]

    def forward_layers_aux(
        self, hidden: torch.Tensor, mrope_positions: torch.Tensor, attn: AttentionBackend,
        layers: range, *, final_norm: bool, aux_layers: Sequence[int] = (),
        extras: StepExtras = NO_EXTRAS,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`forward_layers`, also returning the outputs of those of global layers
        ``aux_layers`` in ``layers`` (``[T, hidden]`` each, by layer id; the residual stream
        after the layer, as :meth:`forward_aux` gives them)."""
        rot = self.rotary(mrope_positions, hidden.dtype)
        x = hidden
        outs: dict[int, torch.Tensor] = {}
        for gid in layers:
            x = self.run_layer(gid, x, rot, attn, self.pool_index(gid, layers), extras)
            if gid in aux_layers:
                outs[gid] = x
        return (self.model.norm.forward(x) if final_norm else x), outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab]``."""
        if self.head is None:  # before fuse() (a model built for training or export)
            return F.linear(hidden, self.lm_head.weight).float()
        return self.head(hidden).float()
