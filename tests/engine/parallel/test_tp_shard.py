"""The tensor-parallel split without processes: which heads and columns a rank holds (and that
only rank 0 holds the embedding, the LM head and the vision tower), the step messages' round
trip, and the split model over two ranks in two threads of one process (summing through a
barrier) giving the hidden states of the whole model, with KV heads split (4 query and 2 KV
heads) and replicated (1 KV head)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.attention.backend import AttentionBatch, TorchPagedAttention
from engine.checkpoint import load_model
from engine.config import ModelConfig, TextConfig
from engine.errors import ConfigError
from engine.kv.pool import KVPool
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.multimodal.mrope import mrope_from_1d
from engine.parallel.group import TPGroup
from engine.parallel.messages import (
    Command,
    RankReport,
    StepHeader,
    move_header,
    pack_step,
    step_header,
    unpack_step,
)
from engine.parallel.shard import TextShard, check_tp_size
from engine.runner.draft_runner import DraftHead


def text_config(heads: int, kv: int, inter: int = 96) -> TextConfig:
    return TextConfig(vocab_size=8, hidden_size=16 * heads, intermediate_size=inter,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                      max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
                      mrope_section=(2, 3, 3))


@pytest.mark.parametrize(("heads", "kv", "size", "kv_here", "starts"), [
    (4, 2, 2, 1, [0, 1]),  # split
    (4, 4, 2, 2, [0, 2]),
    (4, 1, 2, 1, [0, 0]),  # replicated on both ranks
    (8, 2, 4, 1, [0, 0, 1, 1]),  # each KV head on the two ranks whose query heads read it
])
def test_a_rank_holds_the_kv_heads_its_query_heads_read(
        heads: int, kv: int, size: int, kv_here: int, starts: list[int]) -> None:
    cfg = text_config(heads, kv)
    shards = [TextShard.of(cfg, r, size) for r in range(size)]
    assert [s.kv_head_start for s in shards] == starts
    for s in shards:
        assert s.num_kv_heads == kv_here and s.num_heads == heads // size
        first_q = s.rank * s.num_heads
        group = heads // kv  # query heads per KV head
        assert s.kv_head_start == first_q // group
        assert (first_q + s.num_heads - 1) // group < s.kv_head_start + s.num_kv_heads


def test_checkpoint_slices() -> None:
    s = TextShard.of(text_config(4, 2), rank=1, size=2)  # head_dim 16, 48 MLP columns here
    layer = "model.layers.0."
    assert s.slice_of(layer + "self_attn.q_proj.weight") == (0, 32, 64)
    assert s.slice_of(layer + "self_attn.k_proj.bias") == (0, 16, 32)
    assert s.slice_of(layer + "self_attn.o_proj.weight") == (1, 32, 64)
    assert s.slice_of(layer + "mlp.up_proj.weight") == (0, 48, 96)
    assert s.slice_of(layer + "mlp.down_proj.weight") == (1, 48, 96)
    for whole in (layer + "input_layernorm.weight", "lm_head.weight", "visual.blocks.0.mlp.fc1"
                  ".weight", "model.embed_tokens.weight"):
        assert s.slice_of(whole) is None
    assert s.holds(layer + "input_layernorm.weight") and s.holds("model.norm.weight")
    assert not any(s.holds(n) for n in ("lm_head.weight", "visual.merger.mlp.0.weight",
                                        "model.embed_tokens.weight"))
    assert TextShard.of(text_config(4, 2), rank=0, size=2).holds("visual.merger.mlp.0.weight")
    assert TextShard.of(text_config(4, 2)).slice_of(layer + "mlp.up_proj.weight") is None


@pytest.mark.parametrize(("size", "message"), [
    (3, "num_attention_heads"), (0, "at least 1"), (8, "num_attention_heads")])
def test_sizes_that_do_not_split_are_refused(size: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_tp_size(text_config(4, 2), size)


def test_kv_heads_neither_divisible_nor_a_divisor_are_refused() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        check_tp_size(text_config(12, 3, inter=96), 4)
    with pytest.raises(ConfigError, match="intermediate_size"):
        check_tp_size(text_config(4, 2, inter=90), 4)


def test_step_messages_round_trip() -> None:
    batch = AttentionBatch.from_lists([3, 1], [5, 9], [[4, 2], [7, 1, 3]],
                                      torch.tensor([34, 35, 36, 59]))
    mrope = mrope_from_1d(torch.tensor([2, 3, 4, 8]), torch.tensor([0, 0, 0, -3]))
    header = StepHeader.decode(step_header(torch.zeros(4, 6), batch).encode())
    assert (header.command, header.num_tokens, header.hidden) == (Command.FORWARD, 4, 6)
    got_mrope, got = unpack_step(header, pack_step(mrope, batch))
    assert torch.equal(got_mrope, mrope)
    for name in ("q_lens", "kv_lens", "q_starts", "page_table", "slot_mapping"):
        assert torch.equal(getattr(got, name), getattr(batch, name)), name
        assert getattr(got, name).dtype == getattr(batch, name).dtype, name
    assert (got.max_q, got.max_kv) == (batch.max_q, batch.max_kv)
    assert got.tree_mask is None
    assert StepHeader.decode(StepHeader(Command.STOP).encode()).command == Command.STOP


def test_a_draft_steps_tree_mask_and_a_kv_move_round_trip() -> None:
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]] * 2, dtype=torch.bool)  # [2, 3, 3]
    batch = AttentionBatch.from_lists([3, 3], [8, 11], [[4, 2], [7, 1]],
                                      torch.arange(40, 46))
    batch = replace(batch, tree_mask=mask)
    mrope = mrope_from_1d(torch.tensor([5, 6, 6, 8, 9, 9]), torch.tensor([0, 0, 0, 2, 2, 2]))
    header = StepHeader.decode(step_header(torch.zeros(6, 12), batch, Command.DRAFT).encode())
    assert (header.command, header.hidden, header.mask_width) == (Command.DRAFT, 12, 3)
    got_mrope, got = unpack_step(header, pack_step(mrope, batch))
    assert torch.equal(got_mrope, mrope) and torch.equal(got.slot_mapping, batch.slot_mapping)
    assert got.tree_mask is not None and torch.equal(got.tree_mask, mask)
    move = StepHeader.decode(move_header(5).encode())
    assert (move.command, move.num_tokens, move.packed_len()) == (Command.MOVE_KV, 5, 10)
    assert RankReport.decode(RankReport(3, "boom: é").encode()) == RankReport(3, "boom: é")


class ThreadGroup(TPGroup):
    """Ranks as threads of one process: all_reduce sums every rank's tensor, in rank order."""

    def __init__(self, rank: int, size: int, parts: list[torch.Tensor],
                 barrier: threading.Barrier) -> None:
        super().__init__(rank, size)
        self.parts, self.barrier = parts, barrier

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.parts[self.rank] = x.clone()
        self.barrier.wait()
        total = torch.stack(self.parts).sum(0)
        self.barrier.wait()
        return x.copy_(total)


def hidden_states(model: Qwen2VLModel, embeds: torch.Tensor) -> torch.Tensor:
    """The model over one prompt's ``embeds`` ``[T, H]`` in a fresh pool: hidden states
    ``[T, H]``."""
    text = model.cfg.text
    layer = model.model.layers[0]
    pool = KVPool(4, 8, layer.self_attn.num_kv_heads, text.head_dim,
                  list(range(text.num_hidden_layers)))
    attn = TorchPagedAttention(pool)
    t = embeds.shape[0]
    attn.prepare(AttentionBatch.from_lists([t], [t], [[0, 1, 2]], torch.arange(t)))
    return model(embeds, mrope_from_1d(torch.arange(t), 0), attn)


@pytest.mark.parametrize("which", ["split_kv", "replicated_kv"])
def test_two_ranks_give_the_whole_models_hidden_states(
        which: str, hf_dir: Path, hf_one_kv_head_dir: Path) -> None:
    path = hf_dir if which == "split_kv" else hf_one_kv_head_dir
    _, whole = load_model(path)
    embeds = whole.embed(torch.arange(3, 23))  # rank 0 embeds and sends them to the others
    expected = hidden_states(whole, embeds)
    parts: list[torch.Tensor] = [torch.empty(0)] * 2
    barrier = threading.Barrier(2)
    models = [load_model(path, tp=ThreadGroup(r, 2, parts, barrier))[1] for r in range(2)]
    out: list[torch.Tensor] = [torch.empty(0)] * 2

    def run(rank: int) -> None:
        with torch.inference_mode():
            out[rank] = hidden_states(models[rank], embeds)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert models[0].model.layers[0].self_attn.num_kv_heads == 1
    rank_0_only = ("visual.", "lm_head.", "model.embed_tokens.")
    assert any(n.startswith(rank_0_only) for n in models[0].state_dict())
    assert not any(n.startswith(rank_0_only) for n in models[1].state_dict())
    for rank in range(2):
        torch.testing.assert_close(out[rank], expected, rtol=1e-5, atol=1e-5)


def test_a_draft_beside_a_tensor_parallel_target_without_its_ranks_is_refused(
        hf_dir: Path) -> None:
    cfg = ModelConfig.from_dir(hf_dir)
    with torch.device("meta"):
        target = Qwen2VLModel(cfg, TPGroup(0, 2))
    pool = KVPool(4, 8, 1, cfg.text.head_dim, [0])
    with pytest.raises(ConfigError, match="tensor-parallel target needs its other ranks"):
        DraftHead(None, target, pool)  # type: ignore[arg-type]  # refused before it is read
