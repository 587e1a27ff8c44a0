"""The EAGLE-3 draft of the built-in model: its data, vocabulary and training (used by
``scripts/train_tiny.py``).

The target hands the draft the outputs of three of its layers (low, middle, high; layer ``i`` is
the residual stream after decoder layer ``i``), concatenated ``[T, 3H]``; the draft's ``fc`` fuses
them into a feature. Row ``p`` = (fused feature of ``p``, token ``p + 1``) predicts the target's
greedy token ``p + 2`` over the draft's own vocabulary: the ``draft_vocab_size`` tokens the
target emits most often in the training continuations (``d2t`` maps them back). Training unrolls
the draft ``draft_passes`` times as drafting does (training-time test, as EAGLE-3 and HASS do):
pass ``j`` feeds row ``p`` the draft's own output of row ``p - 1`` from pass ``j - 1``, so the
last passes see what draft step ``j`` sees; pass ``j``'s loss weighs ``draft_pass_decay ** j``.
Only the token loss counts (no feature regression). Rows whose target token lies outside the
draft vocabulary are left out of the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tiny_settings import Settings

from engine.models.eagle.draft import DraftConfig, Eagle3Spec, draft_config_dict
from engine.models.eagle.eagle3 import Eagle3Draft
from engine.models.layers import RotaryTables
from engine.models.qwen2_vl.model import Attention, DecoderLayer, Qwen2VLModel


def attention(a: Attention, h: torch.Tensor, rot: RotaryTables) -> torch.Tensor:
    """Causal self-attention of the (unfused) ``a`` over ``h`` ``[B, T, in]``, through
    ``o_proj``: ``[B, T, H]``."""
    b, t, _ = h.shape
    q = rot.apply(a.q_proj(h).view(b, t, a.num_heads, a.head_dim)).transpose(1, 2)
    k = rot.apply(a.k_proj(h).view(b, t, a.num_kv_heads, a.head_dim)).transpose(1, 2)
    v = a.v_proj(h).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
    return a.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def mlp(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The layer's gated MLP over its post-attention norm of ``x``, added to ``x``."""
    m, g = layer.mlp, layer.post_attention_layernorm(x)
    return x + m.down_proj(m.act(m.gate_proj(g)) * m.up_proj(g))


@torch.no_grad()
def target_aux(model: Qwen2VLModel, ids: torch.Tensor, layers: tuple[int, ...],
               rot: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of ``layers`` side by side ``[B, T, 3H]`` and the target's greedy next token
    at every index ``[B, T]``, over ``ids`` ``[B, T]`` (causal, positions from 0)."""
    x = F.embedding(ids, model.model.embed_tokens.weight)
    aux = []
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)  # training builds every layer
        x = mlp(layer, x + attention(layer.self_attn, layer.input_layernorm(x), rot))
        if i in layers:
            aux.append(x)
    return torch.cat(aux, dim=-1), model.lm_head(model.model.norm(x)).argmax(-1)


def vocabulary(nexts: torch.Tensor, size: int, target_vocab: int) -> torch.Tensor:
    """The draft vocabulary: the ``size`` target ids most often in ``nexts``, sorted (ties go to
    the smaller id)."""
    counts = torch.bincount(nexts.flatten(), minlength=target_vocab)
    order = sorted(range(target_vocab), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


def new_draft(target_text: dict[str, Any], s: Settings, vocab: torch.Tensor) -> Eagle3Draft:
    """An untrained EAGLE-3 draft over ``vocab`` (its ``d2t`` set)."""
    raw = draft_config(target_text, s)
    draft = Eagle3Draft(DraftConfig.from_dict(raw))
    draft.d2t.copy_(vocab - torch.arange(len(vocab)))
    return draft


def draft_config(target_text: dict[str, Any], s: Settings) -> dict[str, Any]:
    """The draft's ``config.json`` (pdserve's own EAGLE-3 layout)."""
    return draft_config_dict(target_text, s.num_layers,
                             eagle3=Eagle3Spec(s.draft_layers, s.draft_vocab_size))


def draft_forward(draft: Eagle3Draft, embeds: torch.Tensor, feats: torch.Tensor,
                  rot: RotaryTables) -> torch.Tensor:
    """The draft's layer over rows (embedding of token ``p + 1``, feature of ``p``), each
    ``[B, T, H]``; its output (pre-norm) is the next step's feature."""
    layer = draft.layer
    h = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(feats)), dim=-1)
    return mlp(layer, feats + attention(layer.self_attn, h, rot))


def train(draft: Eagle3Draft, model: Qwen2VLModel, data: tuple[torch.Tensor, ...],
          vocab: torch.Tensor, rot: RotaryTables, s: Settings,
          lr_at: Any) -> list[float]:
    """Train ``draft`` on ``data`` (sequences, aux outputs, greedy next tokens, as
    :func:`target_aux` gives them); returns the loss curve. ``rot``: rope tables of the rows'
    positions; ``lr_at(step, total, peak, warmup)``: the schedule."""
    seqs, auxs, nexts = data
    to_draft = torch.full((s.vocab_size,), -100, dtype=torch.int64)
    to_draft[vocab] = torch.arange(len(vocab))
    gen = torch.Generator().manual_seed(s.seed + 3)
    embed = model.model.embed_tokens.weight
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    draft.train()
    for step in range(s.draft_steps):
        idx = torch.randint(0, len(seqs), (s.draft_batch,), generator=gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.draft_steps, s.draft_lr, s.warmup)
        emb = F.embedding(seqs[idx, 1:], embed)  # token p + 1
        want = to_draft[nexts[idx, 1:]].flatten()  # the target's greedy token p + 2
        feats = draft.fc(auxs[idx, :-1])
        loss = torch.zeros(())
        hits = []
        for j in range(s.draft_passes):
            out = draft_forward(draft, emb, feats, rot)
            logits = draft.lm_head(draft.norm(out)).flatten(0, 1)
            loss = loss + s.draft_pass_decay ** j * F.cross_entropy(logits, want)
            hits.append(float((logits.argmax(-1) == want).float().mean()))
            feats = torch.cat((feats[:, :1], out[:, :-1]), dim=1)  # row p: own output of p - 1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == s.draft_steps - 1:
            print(f"draft step {step:5d} loss {loss.item():.3f} top1 per pass "
                  f"{' '.join(f'{h:.3f}' for h in hits)}", flush=True)
    draft.eval()
    return losses
