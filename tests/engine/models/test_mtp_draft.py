"""The MTP (NEXTN) draft of a Qwen3.5 checkpoint: its module against one built from
transformers' own Qwen3.5 components with the same weights, how it loads (from the target's
``mtp.*`` tensors, the KV in the draft band, split over TP ranks) and how a checkpoint without
one is refused."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.attention.backend import AttentionBatch
from engine.attention.select import make_attention
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.kv.pool import KVPool
from engine.models.eagle.loader import MTP_DRAFT, draft_source, load_draft
from engine.models.eagle.mtp import MtpDraft
from engine.models.linear import PACKING
from engine.parallel.shard import TextShard
from tests.engine.parallel.test_tp_shard import ThreadGroup

ROWS = 11


def hf_text_config(model_dir: Path):  # noqa: ANN201 - transformers config
    from transformers import Qwen3_5Config

    cfg = Qwen3_5Config.from_pretrained(model_dir).text_config
    cfg._attn_implementation = "eager"
    return cfg


def randomize_norms(draft: MtpDraft, seed: int) -> None:
    """Zero-centred norm weights away from 0, so a norm applied to the wrong input shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
                assert "norm" in name, name


def reference(draft: MtpDraft, model_dir: Path, embeds: torch.Tensor, feats: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """The module's output features from transformers' components: its RMSNorm (zero-centred),
    a Linear, its decoder layer of a full-attention index and its rotary embedding, under a
    causal mask, loaded with ``draft``'s weights (names as in the checkpoint)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5RMSNorm,
        Qwen3_5TextRotaryEmbedding,
    )

    cfg = hf_text_config(model_dir)
    full = cfg.layer_types.index("full_attention")
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    state = draft.state_dict()

    def norm(name: str) -> Qwen3_5RMSNorm:
        module = Qwen3_5RMSNorm(h, eps)
        module.weight.data.copy_(state[f"{name}.weight"])
        return module

    fc = torch.nn.Linear(2 * h, h, bias=False)
    fc.weight.data.copy_(state["fc.weight"])
    layer = Qwen3_5DecoderLayer(cfg, full).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in state.items()
                           if k.startswith("layers.0.")})
    x = fc(torch.cat((norm("pre_fc_norm_embedding")(embeds),
                      norm("pre_fc_norm_hidden")(feats)), dim=-1))[None]  # [1, T, H]
    rot = Qwen3_5TextRotaryEmbedding(cfg)(x, positions[:, None, :])
    t = embeds.shape[0]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]
    out = layer(x, position_embeddings=rot, attention_mask=mask)
    return norm("norm")(out)[0]


def run_ours(draft: MtpDraft, text_kv_heads: int, head_dim: int, embeds: torch.Tensor,
             feats: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, KVPool]:
    """Our module over ``ROWS`` rows of one fresh sequence (pages 0 and 1 of a one-layer pool in
    the draft band)."""
    pool = KVPool(4, 8, text_kv_heads, head_dim, [draft.cfg.layer_id], torch.float32, "cpu")
    attn = make_attention(pool)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    attn.prepare(AttentionBatch.build([ROWS], [ROWS], table, torch.arange(ROWS)))
    return draft.forward(embeds, feats, positions, attn), pool


def inputs(hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token embeddings and features ``[ROWS, H]`` and 3-D positions ``[3, ROWS]`` whose axes
    differ (an image's rows), so every mrope section turns by its own axis."""
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(ROWS, hidden, generator=gen)
    feats = torch.randn(ROWS, hidden, generator=gen) * 3
    t = torch.arange(ROWS)
    positions = torch.stack([t, t // 3 + 2, t % 3 + 5])
    return embeds, feats, positions


def test_mtp_module_equals_transformers_components(qwen35_mtp_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """fc over cat(norm(embedding), norm(feature)), transformers' decoder layer (gated q_proj,
    q/k norms, partial interleaved mrope, MLP), the final norm: equal in float32 to 1e-5.
    The weights stay plain (unpacked), so the reference can be loaded from the module's own."""
    monkeypatch.setitem(PACKING, "enabled", False)
    text = ModelConfig.from_dir(qwen35_mtp_dir).text
    draft = load_draft(draft_source(MTP_DRAFT, qwen35_mtp_dir), text, torch.float32)
    assert isinstance(draft, MtpDraft)
    assert draft.cfg.layer_id == text.num_hidden_layers  # the draft band
    randomize_norms(draft, seed=5)
    draft.fuse()
    embeds, feats, positions = inputs(text.hidden_size, seed=1)
    with torch.no_grad():
        want = reference(draft, qwen35_mtp_dir, embeds, feats, positions)
    got, pool = run_ours(draft, text.num_key_value_heads, text.head_dim, embeds, feats,
                         positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert pool.k[0].abs().sum() > 0  # its KV went into the draft pool
    # swapping the two inputs is not the same module: the order is part of what is checked
    swapped, _ = run_ours(draft, text.num_key_value_heads, text.head_dim, feats, embeds,
                          positions)
    assert not torch.allclose(swapped, want, atol=1e-3)


def test_mtp_logits_come_from_the_target_lm_head(qwen35_mtp_dir: Path) -> None:
    from engine.checkpoint import load_model

    _, target = load_model(qwen35_mtp_dir)
    draft = load_draft(qwen35_mtp_dir, target.cfg.text, torch.float32)
    feats = torch.randn(3, target.cfg.text.hidden_size)
    torch.testing.assert_close(draft.logits(feats, target), target.logits(feats))
    assert draft.greedy_tokens(feats, target).tolist() == target.logits(feats).argmax(-1).tolist()


def test_a_checkpoint_without_mtp_weights_is_refused(hf35_dir: Path) -> None:
    text = ModelConfig.from_dir(hf35_dir).text
    with pytest.raises(CheckpointError, match=r"no MTP module \(no mtp\.\* tensors\)"):
        load_draft(draft_source("mtp", hf35_dir), text, torch.float32)


def test_transformers_loads_the_mtp_checkpoint_and_ignores_the_module(
        qwen35_mtp_dir: Path) -> None:
    """The fixture stays a checkpoint transformers reads (it drops ``mtp.*``), whose greedy
    continuation our engine (which skips ``mtp.*`` for the target) reproduces."""
    from transformers import Qwen3_5ForConditionalGeneration

    from engine.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.llm_engine import LLMEngine, Prompt

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(qwen35_mtp_dir).eval()
    ids = torch.tensor([list(range(3, 20))])
    with torch.no_grad():
        want = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           min_new_tokens=8, do_sample=False, pad_token_id=0)[0, 17:].tolist()
    engine = LLMEngine(qwen35_mtp_dir, EngineConfig(num_pages=16, page_size=8))
    got = engine.generate([Prompt(token_ids=ids[0].tolist())],
                          SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert got[0].token_ids == want


def layer_over(draft: MtpDraft, kv_heads: int, head_dim: int, x: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """The module's layer (this rank's share) over one fresh sequence's rows ``x``."""
    pool = KVPool(4, 8, kv_heads, head_dim, [draft.cfg.layer_id], torch.float32, "cpu")
    attn = make_attention(pool)
    attn.prepare(AttentionBatch.build([ROWS], [ROWS], torch.tensor([[0, 1]]),
                                      torch.arange(ROWS)))
    return draft.run_layer(x, positions, attn)


def test_two_ranks_of_the_mtp_layer_give_the_whole_layer(qwen35_mtp_dir: Path) -> None:
    """Loaded for a rank of two (what each rank of a TP engine loads from the checkpoint), the
    layer holds that rank's heads and MLP columns (the gated ``q_proj`` split per head with its
    gates), ``fc`` and the norms whole; the two ranks' layer, all-reduced, is the whole one."""
    text = ModelConfig.from_dir(qwen35_mtp_dir).text
    whole = load_draft(qwen35_mtp_dir, text, torch.float32)
    embeds, feats, positions = inputs(text.hidden_size, seed=2)
    with torch.inference_mode():
        x = whole.layer_input(embeds, feats)
        want = layer_over(whole, text.num_key_value_heads, text.head_dim, x, positions)
    parts: list[torch.Tensor] = [torch.empty(0)] * 2
    barrier = threading.Barrier(2)
    shares = [load_draft(qwen35_mtp_dir, text, torch.float32, tp=ThreadGroup(r, 2, parts,
                                                                             barrier))
              for r in range(2)]
    assert shares[0].fc.weight.shape == whole.fc.weight.shape
    assert shares[0].layer.self_attn.q_proj.weight.shape[0] * 2 == (
        whole.layer.self_attn.q_proj.weight.shape[0])
    out: list[torch.Tensor] = [torch.empty(0)] * 2

    def run(rank: int) -> None:
        heads = TextShard.of(shares[rank].cfg.text, rank, 2).num_kv_heads
        with torch.inference_mode():
            out[rank] = layer_over(shares[rank], heads, text.head_dim, x, positions)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    for rank in range(2):
        torch.testing.assert_close(out[rank], want, atol=1e-5, rtol=1e-5)
