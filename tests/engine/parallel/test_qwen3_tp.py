"""Tensor parallelism of Qwen3-VL and Qwen3.5 over two ranks.

Without processes: which rows of the gated ``q_proj`` and which (several) spans of a Gated
DeltaNet layer's tensors a rank holds, a size that does not split the linear layers' key heads
refused, the step messages carrying a hybrid forward's state step and DeepStack's shape, and the
split model in two threads giving the whole model's hidden states over two chunks (the state
pool carrying the first chunk's context into the second). Over two CPU processes (gloo): greedy
output equal to transformers' for text, one image, and a batch of every case in small chunks
(prefill chunks mixing with decode rows), with the full-attention layers' key/value heads split
(2 over 2 ranks) and replicated (1); nothing left held afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_tp_shard import ThreadGroup

from engine.attention.backend import AttentionBatch, TorchPagedAttention
from engine.checkpoint import load_model
from engine.config import KEEP_ROWS, EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.errors import ConfigError
from engine.kv.pool import KVPool
from engine.llm_engine import LLMEngine, Prompt, hybrid_states
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.step_extras import StepExtras
from engine.multimodal.inputs import ImageInput, VideoInput
from engine.multimodal.mrope import mrope_from_1d
from engine.parallel.messages import (
    Command,
    StateStep,
    StepHeader,
    read_step_message,
    step_header,
    step_message,
)
from engine.parallel.shard import TensorPart, TextShard, check_tp_size
from tests.engine.models.test_qwen3_generation import NEW_TOKENS, Visual, cases, reference

FAMILIES = {"qwen3_vl": ("hf3_dir", "hf3_model", "hf3_one_kv_head_dir", "hf3_one_kv_head_model"),
            "qwen3_5": ("hf35_dir", "hf35_model", "hf35_one_kv_head_dir",
                        "hf35_one_kv_head_model")}
LAYOUTS = ["split_kv", "replicated_kv"]


def family_fixtures(family: str, layout: str, request: pytest.FixtureRequest
                    ) -> tuple[Path, object]:
    """The checkpoint directory and transformers' model of ``family`` in ``layout``."""
    split_dir, split_model, one_dir, one_model = FAMILIES[family]
    names = (split_dir, split_model) if layout == "split_kv" else (one_dir, one_model)
    return request.getfixturevalue(names[0]), request.getfixturevalue(names[1])


# ---- the split, without processes ------------------------------------------------------------


def test_a_rank_holds_its_gated_query_heads_and_its_linear_heads(hf35_dir: Path) -> None:
    text = ModelConfig.from_dir(hf35_dir).text  # 4 heads of 16 (gated), 2 key heads of 8
    s = TextShard.of(text, rank=1, size=2)  # linear: 4 value heads of 8, key dim 16
    layer = "model.layers.0."
    assert s.part_of(layer + "self_attn.q_proj.weight") == TensorPart(0, ((64, 128),))
    assert s.part_of(layer + "self_attn.o_proj.weight") == TensorPart(1, ((32, 64),))
    qkv = TensorPart(0, ((8, 16), (24, 32), (48, 64)))  # its q, k and v channels
    assert s.part_of(layer + "linear_attn.in_proj_qkv.weight") == qkv
    assert s.part_of(layer + "linear_attn.conv1d.weight") == qkv
    assert s.part_of(layer + "linear_attn.in_proj_z.weight") == TensorPart(0, ((16, 32),))
    assert s.part_of(layer + "linear_attn.out_proj.weight") == TensorPart(1, ((16, 32),))
    for heads in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
        assert s.part_of(layer + "linear_attn." + heads) == TensorPart(0, ((2, 4),))
    for whole in ("linear_attn.norm.weight", "self_attn.q_norm.weight", "input_layernorm.weight"):
        assert s.part_of(layer + whole) is None
    with pytest.raises(ValueError, match="3 spans"):
        s.layer_slice("linear_attn.in_proj_qkv.weight")
    here = s.linear_here
    assert here is not None and (here.num_k_heads, here.num_v_heads) == (1, 2)
    assert here.conv_channels == 32


def test_a_size_that_does_not_split_the_linear_key_heads_is_refused(hf35_dir: Path) -> None:
    text = ModelConfig.from_dir(hf35_dir).text  # 2 linear key heads; 4 splits everything else
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        check_tp_size(text, 4)
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        LLMEngine(hf35_dir, EngineConfig(num_pages=8, tp_size=4))
    assert not mp.active_children()


def test_a_hybrid_steps_states_and_deepstacks_shape_travel_with_the_header() -> None:
    batch = AttentionBatch.from_lists([3, 1], [3, 9], [[4], [7, 1]], torch.arange(4))
    states = StateStep((0, 3, 4), (5, 2), (5,))
    header = step_header(torch.zeros(4, 6), batch, Command.FORWARD,
                         (torch.zeros(2, 6), torch.zeros(2, 6), torch.zeros(2, 6)))
    got, got_states = read_step_message(step_message(header, states))
    assert got == header and (got.stack_rows, got.stack_layers) == (2, 3)
    assert got_states == states
    plain = StepHeader(Command.STOP)
    assert read_step_message(step_message(plain)) == (plain, None)
    with pytest.raises(ValueError, match="state step"):
        StateStep.decode(states.encode()[:-8])


def whole_and_split(path: Path) -> list[Qwen2VLModel]:
    """The whole model of ``path``, then its two ranks' shares summing through threads."""
    parts: list[torch.Tensor] = [torch.empty(0)] * 2
    barrier = threading.Barrier(2)
    return [load_model(path)[1]] + [load_model(path, tp=ThreadGroup(r, 2, parts, barrier))[1]
                                    for r in range(2)]


def two_chunks(model: Qwen2VLModel, embeds: torch.Tensor, stack: StepExtras) -> torch.Tensor:
    """The model over one prompt's ``embeds`` ``[T, H]`` in two forwards (the first 12 rows,
    then the rest), in fresh pools; ``stack``: the first forward's DeepStack rows and features.
    Returns the hidden states ``[T, H]``."""
    text, tp = model.cfg.text, model.tp
    shard = TextShard.of(text, tp.rank, tp.size)
    layers = range(text.num_hidden_layers)
    pool = KVPool(4, 8, shard.num_kv_heads, text.head_dim, text.attention_layers(layers))
    attn = TorchPagedAttention(pool)
    states = hybrid_states(text, layers, 2, torch.float32, torch.device("cpu"), shard,
                           verify_states=KEEP_ROWS)
    t, out = embeds.shape[0], []
    for start, stop, extras in ((0, 12, stack), (12, t, StepExtras())):
        n = stop - start
        attn.prepare(AttentionBatch.from_lists([n], [stop], [[0, 1, 2]],
                                               torch.arange(start, stop)))
        if states is not None:
            step = StateStep((0, n), (1,), (1,) if start == 0 else ())
            extras = StepExtras(extras.deepstack_rows, extras.deepstack, step.apply(states))
        out.append(model(embeds[start:stop], mrope_from_1d(torch.arange(start, stop), 0), attn,
                         extras))
    return torch.cat(out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_give_the_whole_models_hidden_states(
        family: str, layout: str, request: pytest.FixtureRequest) -> None:
    path, _ = family_fixtures(family, layout, request)
    whole, *ranks = whole_and_split(path)
    gen = torch.Generator().manual_seed(0)
    embeds = whole.embed(torch.randint(0, 370, (20,), generator=gen))
    stack = StepExtras()
    if family == "qwen3_vl":  # two stacked layers' features at rows 2, 3 and 7
        rows = torch.tensor([2, 3, 7])
        stack = StepExtras(rows, tuple(torch.randn(3, embeds.shape[1], generator=gen)
                                       for _ in range(2)))
    with torch.inference_mode():
        expected = two_chunks(whole, embeds, stack)
    out: list[torch.Tensor] = [torch.empty(0)] * 2

    def run(rank: int) -> None:
        with torch.inference_mode():
            out[rank] = two_chunks(ranks[rank], embeds, stack)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for rank in range(2):
        torch.testing.assert_close(out[rank], expected, rtol=1e-5, atol=1e-5)


# ---- two processes against transformers -------------------------------------------------------


def generate(engine: LLMEngine, prompts: list[tuple[list[int], list[Visual]]]) -> list[list[int]]:
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [Prompt(token_ids=ids,
                    images=[v for v in vis if isinstance(v, ImageInput)],
                    videos=[v for v in vis if isinstance(v, VideoInput)])
             for ids, vis in prompts]
    return [r.token_ids for r in engine.generate(batch, greedy)]


def check_nothing_held(engine: LLMEngine) -> None:
    engine.scheduler.check_no_leaks()
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0
    if engine.states is not None:
        assert stats["state_slots_used"] == 0


@pytest.fixture
def closing() -> Iterator[list[LLMEngine]]:
    """Engines a test builds, closed after it however it ends."""
    engines: list[LLMEngine] = []
    try:
        yield engines
    finally:
        for engine in engines:
            engine.close()
    assert not mp.active_children(), "a rank's process outlived its engine"


@pytest.mark.slow  # a rank's process and a hundred two-process steps (3-10 s a test)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_output_matches_transformers(family: str, layout: str, closing: list[LLMEngine],
                                            request: pytest.FixtureRequest) -> None:
    """Text and one image one at a time, then every case at once with a step budget of 16
    tokens: prompts in many chunks, the chunks of one step mixing with other requests'
    decode rows. The batch's text and image prompts hit the prefix cache; a hybrid model's
    resume at their state checkpoint (every 16 tokens), restored and saved on both ranks."""
    path, hf_model = family_fixtures(family, layout, request)
    config = EngineConfig(num_pages=96, page_size=8, tp_size=2, max_num_batched_tokens=16,
                          state_checkpoint_interval=16)
    closing.append(engine := LLMEngine(path, config))
    assert engine.pool.num_kv_heads == 1  # its one of two KV heads, or the one replicated
    every = cases()
    for name in ("text", "one_image"):
        assert generate(engine, [every[name]]) == [reference(hf_model, *every[name])], name
    prompts = list(every.values())
    assert generate(engine, prompts) == [reference(hf_model, ids, vis) for ids, vis in prompts]
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    if engine.states is not None:
        assert engine.stats()["state_checkpoints_restored"] > 0
    check_nothing_held(engine)
