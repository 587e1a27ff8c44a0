"""EAGLE-3 drafts in the decode loop: greedy output equals plain decoding (text, one image, mixed
batches; chain and tree), a draft built to reproduce its target accepts every token through its
own smaller vocabulary, and the pieces (the target's layer outputs, the vocabulary scatter) on
hand-made numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_eagle import GREEDY, PROMPTS, image_prompt

from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.attention.backend import AttentionBatch, TorchPagedAttention
from engine.builtin.tiny_model import (
    tiny_config_dict,
    write_tiny_eagle3_draft,
)
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.kv.pool import KVPool
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.eagle3 import Eagle3Draft
from engine.models.eagle.loader import load_draft
from tests.decode_node.test_eagle import first_token_chi2
from tests.eagle3_pair import draft_vocab_ids, write_eagle3_model, write_repeating_pair

SHAPES = [(3, 1, 3), (4, 2, 3), (6, 3, 2)]  # (num_draft_tokens, topk, steps); the first a chain


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eagle3_model(tmp_path_factory.mktemp("eagle3"))


@pytest.fixture(scope="module")
def plain_tokens(model_dir: Path) -> dict[str, list[list[int]]]:
    engine = LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8))
    return {case: [r.token_ids for r in engine.generate(prompts, GREEDY)]
            for case, prompts in PROMPTS.items()}


def eagle3_engine(model_dir: Path, n: int, k: int = 1, s: int | None = None) -> EagleEngine:
    shape = TreeShape(n, k, s)
    config = EngineConfig(num_pages=256, page_size=8, lookahead_tokens=shape.lookahead,
                          max_num_batched_tokens=24)
    engine = LLMEngine(model_dir, config)
    draft = load_draft(model_dir / "draft", engine.model_config.text, torch.float32)
    assert isinstance(draft, Eagle3Draft)
    return EagleEngine(engine, draft, n, k, s)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}k{}s{}".format(*s))
@pytest.mark.parametrize("case", list(PROMPTS))
def test_eagle3_greedy_equals_plain_decoding(model_dir: Path,
                                             plain_tokens: dict[str, list[list[int]]],
                                             case: str, shape: tuple[int, int, int]) -> None:
    spec = eagle3_engine(model_dir, *shape)
    assert (spec.trees is None) == (shape[1] == 1)
    got = spec.generate(PROMPTS[case], GREEDY)
    assert [g.token_ids for g in got] == plain_tokens[case]
    assert spec.stats.rounds > 0
    spec.engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("shape", [(3, 1, 3), (4, 2, 3)], ids=["chain", "tree"])
def test_a_reproducing_eagle3_draft_accepts_its_vocabulary(tmp_path: Path,
                                                           shape: tuple[int, int, int]) -> None:
    """Every token the draft vocabulary holds is guessed right (the whole depth, every round);
    a token outside it never is (nothing accepted): output equal to plain decoding either way."""
    model_dir = write_repeating_pair(tmp_path / "pair", draft_vocab=128)
    inside = draft_vocab_ids(128)
    hit = next(t for t in range(20, 512) if t in inside)
    miss = next(t for t in range(20, 512) if t not in inside)
    prompts = [Prompt(token_ids=[5, 6, hit]), Prompt(token_ids=[5, 6, miss]),
               image_prompt([1, 2], (1, 4, 4), [hit], 4)]
    depth = shape[2]
    params = SamplingParams(max_new_tokens=1 + 3 * (depth + 1), ignore_eos=True)
    plain = LLMEngine(model_dir, EngineConfig(num_pages=64, page_size=8)).generate(prompts,
                                                                                  params)
    assert [p.token_ids for p in plain] == [[hit] * params.max_new_tokens,
                                            [miss] * params.max_new_tokens,
                                            [hit] * params.max_new_tokens]
    spec = eagle3_engine(model_dir, *shape)
    got = spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    stats = [spec.request_stats[g.request_id] for g in got]
    assert [s.accepted for s in stats] == [3 * depth, 0, 3 * depth]
    assert [s.rounds for s in stats] == [3, 3 * (depth + 1), 3]
    spec.engine.scheduler.check_no_leaks()


def test_target_layer_outputs_are_the_residual_stream_after_each_layer(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, EngineConfig(num_pages=8, page_size=8))
    model = engine.model
    pool = KVPool(2, 8, 2, 16, [0, 1])
    attn = TorchPagedAttention(pool)
    attn.prepare(AttentionBatch.from_lists([5], [5], [[0]], torch.arange(5)))
    embeds = model.embed(torch.tensor([3, 4, 5, 6, 7]))
    pos = torch.arange(5).expand(3, -1)
    hidden, aux = model.forward_aux(embeds, pos, attn, (1, 0, 1))
    rot = model.rotary(pos, embeds.dtype)
    attn.prepare(AttentionBatch.from_lists([5], [5], [[1]], torch.arange(8, 13)))
    x0 = model.model.layers[0](embeds, rot, attn, 0)
    x1 = model.model.layers[1](x0, rot, attn, 1)
    torch.testing.assert_close(aux, torch.cat((x1, x0, x1), dim=-1))
    torch.testing.assert_close(hidden, model.model.norm(x1))


def test_draft_logits_sit_at_their_target_ids(tmp_path: Path) -> None:
    """The draft's logits over its own vocabulary land at ``d + d2t[d]``; every other target id
    is ``-inf``, so an argmax or top-k picks target ids of the draft vocabulary."""
    draft_dir = write_tiny_eagle3_draft(tmp_path / "draft", draft_vocab=40)
    target = ModelConfig.from_dict(tiny_config_dict()).text
    draft = load_draft(draft_dir, target, torch.float32)
    assert isinstance(draft, Eagle3Draft)
    feats = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    small = torch.nn.functional.linear(draft.norm(feats), draft.lm_head.weight)  # [3, 40]
    got = draft.logits(feats, None)  # type: ignore[arg-type]  # the target is not used
    ids = torch.arange(40) + draft.d2t
    assert got.shape == (3, 512)
    torch.testing.assert_close(got[:, ids], small)
    rest = torch.ones(512, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(got[:, rest]).all()
    assert got.argmax(-1).tolist() == ids[small.argmax(-1)].tolist()


@pytest.mark.parametrize("descending", [False, True], ids=["ascending map", "descending map"])
def test_greedy_tokens_are_the_argmax_of_the_full_logits(tmp_path: Path,
                                                         descending: bool) -> None:
    """``greedy_tokens`` (the loop's greedy pick, which skips the full-vocabulary rows when the
    draft -> target map ascends) equals the argmax of :meth:`Eagle3Draft.logits`, ties
    included: with every draft logit equal, the first maximum is the smallest target id."""
    draft_dir = write_tiny_eagle3_draft(tmp_path / "draft", draft_vocab=40)
    target = ModelConfig.from_dict(tiny_config_dict()).text
    draft = load_draft(draft_dir, target, torch.float32)
    assert isinstance(draft, Eagle3Draft) and draft.ids_increasing
    if descending:
        ids = (torch.arange(40) + draft.d2t).flip(0)
        draft.d2t.copy_(ids - torch.arange(40))
        draft.fuse()
        assert not draft.ids_increasing
    feats = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # random logits, then every logit of a row equal
        want = draft.logits(feats, None).argmax(-1)  # type: ignore[arg-type]
        assert draft.greedy_tokens(feats, None).tolist() == want.tolist()  # type: ignore[arg-type]
        draft.lm_head.weight.data[:] = draft.lm_head.weight.data[0]
    assert want.tolist() == [int(draft.target_ids.min())] * 6


@pytest.mark.parametrize("shape", [(3, 1, 3), (4, 2, 3)], ids=["chain", "tree"])
def test_sampled_requests_run_through_the_draft_vocabulary(model_dir: Path,
                                                           shape: tuple[int, int, int]) -> None:
    """Sampling draws drafts from a distribution that is zero outside the draft vocabulary (the
    ``-inf`` logits); verification stays lossless whatever ``q`` is, so the run only has to
    finish with every token a real one and nothing leaked."""
    spec = eagle3_engine(model_dir, *shape)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=4,
                            ignore_eos=True)
    got = spec.generate(PROMPTS["mixed"], params)
    assert all(len(g.token_ids) == 20 and all(0 <= t < 512 for t in g.token_ids) for g in got)
    assert spec.stats.rounds > 0
    spec.engine.scheduler.check_no_leaks()


def test_sampling_from_a_draft_vocabulary_keeps_the_target_distribution() -> None:
    """An EAGLE-3 draft's distribution is zero outside its vocabulary (here ids 1 and 3 of 5);
    rejection sampling still yields the target's distribution, those ids included (they come
    from the residual)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    p = torch.softmax(torch.randn(3, vocab, generator=gen), dim=-1)
    logits = torch.full((2, vocab), float("-inf"))
    logits[:, [0, 2, 4]] = torch.randn(2, 3, generator=gen)
    q = torch.softmax(logits, dim=-1)
    assert q[:, [1, 3]].eq(0).all()
    assert first_token_chi2(p, q, gen) < 20.5  # p = 0.0004 at 4 degrees of freedom
