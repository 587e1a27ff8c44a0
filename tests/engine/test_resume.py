"""A request resubmitted after a failover (``SamplingParams.resumed_tokens``): its prompt ends
with the output the client already has, and with penalties that output still counts as output,
so greedy decoding continues exactly as an uninterrupted run would have."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import build_state
from engine.sampling.penalties import TokenHistory
from tests.engine.test_generation_vs_transformers import IMG, VS, image, image_block, text

PROMPT = [(j * 29) % 500 for j in range(23)]
NEW, CUT = 24, 9


def test_history_counts_resumed_tokens_as_output() -> None:
    prompt, out = [4, 5, 6], [7, 7, 5]
    fresh = TokenHistory(prompt, 16, torch.device("cpu"))
    fresh.update(out)
    resumed = TokenHistory(prompt + out, 16, torch.device("cpu"), resumed=len(out))
    assert torch.equal(fresh.counts, resumed.counts)
    assert torch.equal(fresh.prompt_seen | (fresh.counts > 0), resumed.prompt_seen)
    resumed.update([9])  # its own outputs are counted on top, from the first one
    assert resumed.counts[9] == 1 and resumed.counts[7] == 2


@pytest.mark.parametrize("penalties", [
    {"frequency_penalty": -2.0},  # rewards repeating output: the head must count
    {"presence_penalty": 1.2, "repetition_penalty": 1.3},
])
def test_resumed_greedy_run_equals_uninterrupted(tiny_dir: Path,
                                                 penalties: dict[str, float]) -> None:
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=256, page_size=8))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, **penalties)
    [whole] = engine.generate([Prompt(token_ids=PROMPT)], params)
    head = whole.token_ids[:CUT]
    resumed = replace(params, max_new_tokens=NEW - CUT, resumed_tokens=CUT)
    [tail] = engine.generate([Prompt(token_ids=PROMPT + head)], resumed)
    assert head + tail.token_ids == whole.token_ids
    # without the mark, the same resubmission counts the head as prompt: the output differs
    [plain] = engine.generate([Prompt(token_ids=PROMPT + head)],
                              replace(resumed, resumed_tokens=0))
    if "frequency_penalty" in penalties:
        assert plain.token_ids != tail.token_ids


def test_resumed_tokens_must_leave_a_prompt(tiny_dir: Path) -> None:
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=64, page_size=8))
    with pytest.raises(InvalidRequestError, match="resumed_tokens 3 must be less"):
        engine.generate([Prompt(token_ids=[1, 2, 3])],
                        SamplingParams(max_new_tokens=2, resumed_tokens=3))
    with pytest.raises(InvalidRequestError, match="resumed_tokens must be at least 0"):
        engine.generate([Prompt(token_ids=[1, 2, 3])],
                        SamplingParams(max_new_tokens=2, resumed_tokens=-1))


def test_resumed_image_prompt_equals_uninterrupted(hf_dir: Path) -> None:
    a = image((1, 4, 6), 1)
    prompt = text(3, 1) + image_block(a) + text(5, 2)
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=256, page_size=8))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    [whole] = engine.generate([Prompt(token_ids=prompt, images=[a])], params)
    head = whole.token_ids[:CUT]
    [tail] = engine.generate([Prompt(token_ids=prompt + head, images=[a])],
                             replace(params, max_new_tokens=NEW - CUT, resumed_tokens=CUT))
    assert head + tail.token_ids == whole.token_ids


def test_resumed_vision_placeholder_ids_are_text(hf_dir: Path) -> None:
    """Output may hold a vision placeholder's id: resumed, it is a text token at the position
    decoding gave it (n + delta), and takes no vision embedding."""
    a = image((1, 4, 6), 1)
    prompt = text(3, 1) + image_block(a) + text(5, 2)
    head = [IMG, VS, IMG, 7]
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=256, page_size=8))
    cfg = engine.model_config
    plain = build_state(prompt, [a], cfg)
    state = build_state(prompt + head, [a], cfg, resumed=len(head))
    n = len(prompt)
    assert plain.mrope_table is not None and state.mrope_table is not None
    assert state.delta == plain.delta
    assert torch.equal(state.mrope_table[:, :n], plain.mrope_table)
    assert torch.equal(state.mrope_table[:, n:],
                       (torch.arange(n, n + len(head)) + plain.delta).expand(3, -1))
    assert state.image_prefix is not None and plain.image_prefix is not None
    assert list(state.image_prefix[n:]) == [plain.image_prefix[n]] * (len(head) + 1)
    with pytest.raises(InvalidRequestError, match="image tokens past"):
        build_state(prompt + head, [a], cfg)  # unmarked, they would be image tokens
    [out] = engine.generate([Prompt(token_ids=prompt + head, images=[a])],
                            SamplingParams(max_new_tokens=4, ignore_eos=True,
                                           resumed_tokens=len(head)))
    assert len(out.token_ids) == 4
