"""A target and an EAGLE-3 draft built so that the draft's guesses are known: the target repeats
its last token, the draft guesses it exactly when its own vocabulary holds it. Acceptance then
shows the features reaching the draft are the right ones (equality with plain decoding alone
would hold with any features)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.builtin.tiny_model import (
    init_weights,
    random_vocab_map,
    tiny_config_dict,
    write_tiny_eagle3_draft,
    write_tiny_model,
)
from engine.builtin.tiny_tokenizer import build_tiny_tokenizer
from engine.checkpoint import save_weights
from engine.config import ModelConfig
from engine.models.eagle.draft import DraftConfig, Eagle3Spec, draft_config_dict
from engine.models.eagle.eagle3 import Eagle3Draft
from engine.models.qwen2_vl.model import Qwen2VLModel

PEAK = 100.0  # the LM heads' scale: a token's logits peak sharply at itself
D2T_SEED = 7


def write_eagle3_model(root: Path) -> Path:
    """The built-in-shaped tiny model in ``root/model`` with a random EAGLE-3 draft in its
    ``draft`` folder (acceptance near zero: tests of equality and of sampling only)."""
    path = write_tiny_model(root / "model")
    write_tiny_eagle3_draft(path / "draft")
    return path


def draft_vocab_ids(draft_vocab: int) -> set[int]:
    """The target ids of the pair's draft vocabulary."""
    return set((torch.arange(draft_vocab) + random_vocab_map(512, draft_vocab, D2T_SEED)).tolist())


def write_repeating_pair(path: Path, draft_vocab: int) -> Path:
    """A one-layer target that repeats its last token (attention and MLP outputs zero, LM head
    = a scaled embedding: a token's logits peak sharply at itself) and an EAGLE-3 draft that
    reproduces it through a vocabulary of ``draft_vocab`` of its tokens: ``fc`` passes layer
    0's output (the token's embedding) through, permuted; the draft layer adds nothing; its LM
    head holds the permuted, scaled embedding rows of its vocabulary. A draft then guesses the
    last token exactly when it is in the draft vocabulary (and a tree's best path is that guess
    at every depth)."""

    raw = tiny_config_dict()
    raw["text_config"]["num_hidden_layers"] = 1
    path.mkdir(parents=True)
    target = Qwen2VLModel(ModelConfig.from_dict(raw))
    init_weights(target, seed=5)
    layer = target.model.layers[0]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        target.lm_head.weight.copy_(target.model.embed_tokens.weight * PEAK)
    save_weights(target, path)
    (path / "config.json").write_text(json.dumps(raw))
    build_tiny_tokenizer().save(str(path / "tokenizer.json"))
    spec = Eagle3Spec((0, 0, 0), draft_vocab)
    draft_raw = draft_config_dict(raw["text_config"], 1, eagle3=spec)
    draft = Eagle3Draft(DraftConfig.from_dict(draft_raw))
    init_weights(draft, seed=6)
    hidden = raw["text_config"]["hidden_size"]
    d2t = random_vocab_map(raw["text_config"]["vocab_size"], draft_vocab, seed=D2T_SEED)
    # fc turns the third layer output (layer 0's: the token's embedding) by a permutation the
    # LM head undoes, so a feature that skipped fc (the target's final state) guesses wrong
    perm = torch.eye(hidden)[torch.randperm(hidden, generator=torch.Generator().manual_seed(8))]
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([torch.zeros(hidden, 2 * hidden), perm], dim=1))
        draft.layer.self_attn.o_proj.weight.zero_()
        draft.layer.mlp.down_proj.weight.zero_()
        draft.d2t.copy_(d2t)
        rows = torch.arange(draft_vocab) + d2t
        draft.lm_head.weight.copy_(target.model.embed_tokens.weight[rows] @ perm.T * PEAK)
    (path / "draft").mkdir()
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()},
              str(path / "draft" / "model.safetensors"))
    (path / "draft" / "config.json").write_text(json.dumps(draft_raw))
    return path
