"""Tensor parallelism over two CPU processes (gloo): greedy output equals transformers' for text
and image prompts, with the key/value heads split over the ranks (4 query and 2 KV heads) and
replicated on them (1 KV head); no page is left held after either; a dead rank fails the step
with an error that names it, and closing ends every rank's process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.errors import ConfigError, TensorParallelError
from engine.llm_engine import LLMEngine, Prompt
from tests.engine.test_generation_vs_transformers import NEW_TOKENS, cases, reference

pytestmark = pytest.mark.slow  # each test starts a rank's process (5-10 s a test)

GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [cases()["text_only"], cases()["one_image"]]


def tp_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(num_pages=64, page_size=8, tp_size=2))


def check_against_transformers(engine: LLMEngine, hf_model) -> None:  # noqa: ANN001
    results = engine.generate([Prompt(token_ids=ids, images=ims) for ids, ims in PROMPTS], GREEDY)
    for (ids, images), ours in zip(PROMPTS, results, strict=True):
        assert ours.token_ids == reference(hf_model, ids, images)
    engine.scheduler.check_no_leaks()


@pytest.fixture
def engine_of() -> Iterator[list[LLMEngine]]:
    """Engines a test builds, closed after it however it ends."""
    engines: list[LLMEngine] = []
    yield engines
    for engine in engines:
        engine.close()
    assert not mp.active_children(), "a rank's process outlived its engine"


def test_split_kv_heads_match_transformers(hf_dir: Path, hf_model, engine_of) -> None:  # noqa: ANN001
    engine_of.append(engine := tp_engine(hf_dir))
    assert engine.pool.num_kv_heads == 1  # 2 KV heads over 2 ranks
    check_against_transformers(engine, hf_model)


def test_replicated_kv_head_matches_transformers_and_a_dead_rank_is_named(
        hf_one_kv_head_dir: Path, engine_of) -> None:  # noqa: ANN001
    from transformers import Qwen2VLForConditionalGeneration

    hf_model = Qwen2VLForConditionalGeneration.from_pretrained(hf_one_kv_head_dir).eval()
    engine_of.append(engine := tp_engine(hf_one_kv_head_dir))
    assert engine.pool.num_kv_heads == 1  # the one KV head, on both ranks
    check_against_transformers(engine, hf_model)

    assert engine.tp is not None
    [rank1] = mp.active_children()
    os.kill(rank1.pid, signal.SIGKILL)
    rank1.join()
    engine.add_request(PROMPTS[0][0], sampling=GREEDY)
    with pytest.raises(TensorParallelError, match="rank 1"):
        engine.step()


def test_a_tp_size_the_heads_do_not_split_into_is_refused(hf_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_attention_heads"):
        LLMEngine(hf_dir, EngineConfig(num_pages=8, tp_size=3))
    assert not mp.active_children()
