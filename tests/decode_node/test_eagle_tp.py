"""EAGLE over a tensor-parallel target (two CPU processes, gloo): the draft's layer is split over
the ranks like the target's and each rank keeps its key/value heads of the draft band.

On a batch of text and image prompts, for a draft tree, an EAGLE-1/2 draft and an EAGLE-3 one:
greedy output equals plain decoding, every draft forward's output features equal those of
the same EAGLE engine in one process, and so do every request's drafted and accepted counts.
Output equality alone would hold whatever the draft computed; the features show each rank's
share of the draft layer and of its KV is right. The leak check follows, and every rank's
process ends with its engine."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from test_eagle import GREEDY, PROMPTS, write_oracle_pair

from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.llm_engine import LLMEngine
from engine.runner.draft_runner import DraftRunner
from tests.eagle3_pair import write_eagle3_model

pytestmark = pytest.mark.slow  # each test starts a rank's process

BATCH = [p for prompts in PROMPTS.values() for p in prompts]  # text, image and mixed at once


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model directories with their draft in ``draft/``: an EAGLE-1/2 draft that approximates
    its two-layer target (partial acceptance), and a random EAGLE-3 draft."""
    root = tmp_path_factory.mktemp("eagle_tp")
    return {"eagle": write_oracle_pair(root / "pair", exact=False),
            "eagle3": write_eagle3_model(root / "eagle3")}


def spec_engine(model_dir: Path, shape: tuple[int, int, int], tp: int) -> EagleEngine:
    config = EngineConfig(num_pages=256, page_size=8, lookahead_tokens=TreeShape(*shape).lookahead,
                          max_num_batched_tokens=24, tp_size=tp)
    engine = LLMEngine(model_dir, config, draft=model_dir / "draft")
    return EagleEngine(engine, engine.load_draft(), *shape)


def run(spec: EagleEngine) -> tuple[list[list[int]], list[tuple[int, int]], list[torch.Tensor]]:
    """Greedy tokens of :data:`BATCH`, each request's (drafted, accepted) and the output
    features of every draft forward, in order."""
    features: list[torch.Tensor] = []
    forward = spec.drafter.forward

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = forward(*args, **kwargs)
        features.append(out.clone())
        return out

    spec.drafter.forward = recording  # type: ignore[method-assign]
    got = spec.generate(BATCH, GREEDY)
    stats = [spec.request_stats[g.request_id] for g in got]
    spec.engine.scheduler.check_no_leaks()
    return [g.token_ids for g in got], [(s.drafted, s.accepted) for s in stats], features


@pytest.mark.parametrize("flavour", ["eagle", "eagle3"])
def test_tp2_draft_tree_equals_the_one_process_draft(drafts: dict[str, Path],
                                                     flavour: str) -> None:
    """A tree of 4 nodes, top-2, 3 steps: its verify mask and the accepted path's KV moves run
    on both ranks (chains: tests/cluster/test_eagle_tp_cluster.py)."""
    model_dir, shape = drafts[flavour], (4, 2, 3)
    plain = LLMEngine(model_dir, EngineConfig(num_pages=256, page_size=8)).generate(BATCH, GREEDY)
    tokens, counts, features = run(spec_engine(model_dir, shape, 1))
    assert tokens == [p.token_ids for p in plain]
    spec = spec_engine(model_dir, shape, 2)
    try:
        assert spec.engine.pool.num_kv_heads == 1 and spec.drafter.pool.num_kv_heads == 1
        kept, spec.engine.draft_dir = spec.engine.draft_dir, None  # as if its ranks had none
        with pytest.raises(ConfigError, match="must be given to the engine"):
            DraftRunner(spec.engine, spec.drafter.draft)
        spec.engine.draft_dir = kept
        tp_tokens, tp_counts, tp_features = run(spec)
    finally:
        spec.engine.close()
    assert not mp.active_children(), "a rank's process outlived its engine"
    assert tp_tokens == tokens
    assert tp_counts == counts
    if flavour == "eagle":  # the approximating draft: drafts are accepted, not only equal
        assert sum(a for _, a in counts) > 0
    assert len(tp_features) == len(features)
    for ours, whole in zip(tp_features, features, strict=True):
        torch.testing.assert_close(ours, whole, rtol=1e-4, atol=1e-4)
