"""The EAGLE-3 draft head: one decoder layer over (normed token embedding, normed feature).

Against the EAGLE-1/2 draft (:class:`~engine.models.eagle.draft.EagleDraft`):

- The target hands the draft the outputs of three of its layers (low, middle, high;
  :class:`~engine.models.eagle.draft.Eagle3Spec`), concatenated ``[T, 3H]``; ``fc`` (no bias) fuses
  them into the feature ``[T, H]`` (:meth:`Eagle3Draft.target_feature`). ``fc`` runs once, on
  the target's side of the hand-over: the feature has the target's hidden size, so the aux row a
  prefill node ships and the decode loop's buffers keep their size.
- The layer's attention reads ``cat(input_layernorm(embedding), hidden_norm(feature))``
  ``[T, 2H]``; the residual stream starts from the feature itself.
- The layer's output before the final norm is the feature of the next draft step (no ``fc``
  again); the logits come from ``norm`` and the draft's own ``lm_head`` over a draft vocabulary
  of ``draft_vocab_size`` tokens. Draft token ``d`` is target token ``d + d2t[d]``
  (:meth:`Eagle3Draft.logits` scatters the draft logits onto the target's vocabulary, ``-inf``
  elsewhere, so every loop picks target ids as with any draft).

The embedding is the target's; the draft's KV lives in the draft band as for every draft.
Tensor names (pdserve's own layout): ``fc.weight`` ``[H, 3H]``, ``layers.0.input_layernorm``,
``layers.0.hidden_norm``, ``layers.0.self_attn.{q,k,v}_proj`` (``[*, 2H]``, with biases),
``layers.0.self_attn.o_proj``, ``layers.0.post_attention_layernorm``, ``layers.0.mlp.*``,
``norm.weight``, ``lm_head.weight`` ``[draft_vocab_size, H]``, ``d2t`` (int64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import TextConfig
from engine.errors import CheckpointError
from engine.models.eagle.draft import DraftConfig, EagleDraft
from engine.models.eagle.mtp import MtpDraft
from engine.models.layers import MropeRotary, RMSNorm, RotaryTables
from engine.models.qwen2_vl.model import Attention, Mlp, Qwen2VLModel
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TextShard


class Eagle3Layer(nn.Module):
    """The EAGLE-3 draft's decoder layer: attention over the normed embedding and feature side
    by side, residual from the feature."""

    def __init__(self, cfg: TextConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        h = cfg.hidden_size
        shard = TextShard.of(cfg, tp.rank, tp.size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, tp, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = Mlp(cfg, shard, tp)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, rot: RotaryTables,
                attn: AttentionBackend, layer: int) -> torch.Tensor:
        """``embeds``, ``feature`` ``[T, H]`` -> the layer's output ``[T, H]`` (pre-norm)."""
        x = torch.cat((self.input_layernorm.forward(embeds),
                       self.hidden_norm.forward(feature)), dim=-1)  # [T, 2H]
        h = feature + self.self_attn.forward(x, rot, attn, layer)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft of ``cfg`` (whose ``eagle3`` is set; its layer split over ``tp``); the
    interface of :class:`~engine.models.eagle.draft.EagleDraft`."""

    def __init__(self, cfg: DraftConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        assert cfg.eagle3 is not None, "an EAGLE-3 draft needs its Eagle3Spec"
        t, spec = cfg.text, cfg.eagle3
        self.cfg = cfg
        self.fc = nn.Linear(len(spec.aux_layer_ids) * t.hidden_size, t.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(t, tp)])
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.lm_head = nn.Linear(t.hidden_size, spec.draft_vocab_size, bias=False)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        self.target_ids = torch.empty(0, dtype=torch.int64)  # set by fuse()
        self.ids_increasing = False  # whether target_ids ascend (set by fuse())
        self.rotary = MropeRotary(t.head_dim, t.rope_theta, t.mrope_section)

    @property
    def layer(self) -> Eagle3Layer:
        """The draft's one decoder layer (``layers.0`` in the checkpoint)."""
        layer = self.layers[0]
        assert isinstance(layer, Eagle3Layer)
        return layer

    def fuse(self) -> None:
        """Fuse projections and derive the draft -> target id table; call once loaded."""
        self.layer.self_attn.fuse()
        self.layer.mlp.fuse()
        self.target_ids = ids = vocab_map(self.d2t, self.cfg.text.vocab_size)
        self.ids_increasing = not ids.is_meta and bool((ids[1:] > ids[:-1]).all())

    def target_feature(self, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The feature a target row hands the draft: ``fc`` over the outputs ``aux``
        ``[T, 3H]`` of the draft's target layers (``hidden``, the final state, is not used)."""
        return self.fc(aux)

    def forward(
        self,
        token_embeds: torch.Tensor,
        features: torch.Tensor,
        mrope_positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Rows ``(embedding of token p+1, feature of p)`` at ``mrope_positions`` ``[3, T]``;
        writes the draft KV through ``attn`` and returns the next step's features ``[T, H]``
        (the layer's output before the final norm)."""
        return self.run_layer(self.layer_input(token_embeds, features), mrope_positions, attn)

    def layer_input(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The rows entering the decoder layer: both ``[T, H]`` side by side, ``[T, 2H]``."""
        return torch.cat((token_embeds, features), dim=-1)

    def run_layer(self, x: torch.Tensor, mrope_positions: torch.Tensor,
                  attn: AttentionBackend) -> torch.Tensor:
        """The decoder layer over :meth:`layer_input`'s rows (this rank's share of it)."""
        embeds, features = x.chunk(2, dim=-1)
        rot = self.rotary(mrope_positions, x.dtype)
        return self.layer.forward(embeds, features, rot, attn, 0)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The output features of the layer's output: the output itself (the final norm comes
        before the LM head only)."""
        return x

    def logits(self, features: torch.Tensor, target: Qwen2VLModel) -> torch.Tensor:
        """Float32 logits ``[n, V]`` over the target's vocabulary of ``features`` ``[n, H]``:
        the draft vocabulary's logits at their target ids, ``-inf`` at every other id."""
        small = self._draft_logits(features).float()  # [n, Vd]
        out = small.new_full((small.shape[0], self.cfg.text.vocab_size), float("-inf"))
        return out.index_copy_(1, self.target_ids, small)

    def greedy_tokens(self, features: torch.Tensor, target: Qwen2VLModel) -> torch.Tensor:
        """``logits(features, target).argmax(-1)`` ``[n]`` (target ids), without building the
        full-vocabulary rows when the draft -> target map ascends (the usual layout): the first
        maximum over the draft vocabulary is then the first over the target's."""
        if not self.ids_increasing:
            return self.logits(features, target).argmax(dim=-1)
        return self.target_ids[self._draft_logits(features).argmax(dim=-1)]

    def _draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[n, Vd]``, in the model's dtype."""
        return F.linear(self.norm.forward(features), self.lm_head.weight)


def vocab_map(d2t: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """The target id of every draft id, ``arange(Vd) + d2t`` ``[Vd]``; ``CheckpointError``
    unless they are distinct ids of the target's vocabulary (unchecked on ``meta``: no
    values)."""
    ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    if ids.is_meta:
        return ids
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab):
        raise CheckpointError(f"d2t maps draft ids outside the target's vocabulary of "
                              f"{target_vocab} (ids {int(ids.min())}..{int(ids.max())})")
    if ids.unique().numel() != ids.numel():
        raise CheckpointError("d2t maps several draft ids onto one target id")
    return ids


def build_draft(cfg: DraftConfig, tp: TPGroup = SINGLE) -> EagleDraft | Eagle3Draft:
    """The draft module ``cfg`` describes (EAGLE-3 when ``cfg.eagle3`` is set), its layer split
    over ``tp``."""
    return EagleDraft(cfg, tp) if cfg.eagle3 is None else Eagle3Draft(cfg, tp)


Draft = EagleDraft | Eagle3Draft | MtpDraft  # what every draft loop runs
