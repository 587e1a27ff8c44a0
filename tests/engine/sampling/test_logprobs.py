"""Log-probabilities against transformers: each output token's alternatives (``top_logprobs``)
and the prompt's log-probabilities (``prompt_logprobs``), through chunked prefill, images and
the prefix cache, equal ``log_softmax`` of transformers' logits within 1e-4 (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.errors import InvalidRequestError
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from engine.sampling.logprobs import top_logprobs
from tests.engine.test_generation_vs_transformers import IMG, cases

K = 5
ASK = SamplingParams(max_new_tokens=6, ignore_eos=True, top_logprobs=K, prompt_logprobs=K)


def hf_logprobs(hf_model, prompt: Prompt, result: GenerationResult) -> torch.Tensor:  # noqa: ANN001
    """transformers' log-probabilities at every position of prompt + output ``[n, V]``."""
    ids = torch.tensor([[*prompt.token_ids, *result.token_ids]])
    kwargs = {}
    if prompt.images:
        kwargs = {"pixel_values": torch.cat([im.patches for im in prompt.images]),
                  "image_grid_thw": torch.tensor([im.grid_thw for im in prompt.images]),
                  "mm_token_type_ids": (ids == IMG).int()}
    with torch.no_grad():
        logits = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def assert_matches(hf_model, prompt: Prompt, got: GenerationResult) -> None:  # noqa: ANN001
    ref = hf_logprobs(hf_model, prompt, got)
    n = len(prompt.token_ids)
    targets = torch.tensor([*prompt.token_ids[1:], *got.token_ids])
    want = ref[:-1].gather(1, targets.unsqueeze(1)).squeeze(1)  # position p scores token p + 1
    assert len(got.prompt_logprobs) == n - 1 == len(got.prompt_top_logprobs)
    close = {"atol": 1e-4, "rtol": 0}
    torch.testing.assert_close(torch.tensor(got.prompt_logprobs), want[: n - 1], **close)
    torch.testing.assert_close(torch.tensor(got.logprobs), want[n - 1 :], **close)
    assert len(got.top_logprobs) == len(got.token_ids)
    tops = [*got.prompt_top_logprobs, *got.top_logprobs]
    values, ids = ref[:-1].topk(K, dim=-1)
    for p, top in enumerate(tops):
        assert len(top.token_ids) == K
        torch.testing.assert_close(torch.tensor(top.logprobs), values[p], **close)
        # the same alternatives (a near tie may swap two neighbours' order)
        assert sorted(top.token_ids) == sorted(ids[p].tolist()) or \
            torch.allclose(values[p, :-1] - values[p, 1:], torch.zeros(K - 1), atol=1e-4)


@pytest.mark.parametrize("name", ["text_only", "two_images_of_different_sizes"])
def test_prompt_and_top_logprobs_match_transformers(name: str, hf_dir: Path, hf_model) -> None:  # noqa: ANN001,E501
    ids, images = cases()[name]
    prompt = Prompt(token_ids=ids, images=images)
    # an 8-token budget: the prompt runs in several chunks, each recording its positions
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=8, max_num_batched_tokens=8))
    [got] = engine.generate([prompt], ASK)
    assert_matches(hf_model, prompt, got)
    engine.scheduler.check_no_leaks()


def test_prompt_logprobs_bypass_the_prefix_cache(hf_dir: Path, hf_model) -> None:  # noqa: ANN001
    ids, _ = cases()["text_only"]
    prompt = Prompt(token_ids=[*ids, *ids])
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=4, enable_prefix_cache=True))
    plain = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.generate([prompt], plain)
    [cached] = engine.generate([prompt], plain)
    assert engine.stats()["prefix_cache_hit_tokens"] > 0  # the cache would have served it
    before = engine.stats()["prefix_cache_hit_tokens"]
    [got] = engine.generate([prompt], ASK)
    assert engine.stats()["prefix_cache_hit_tokens"] == before
    assert got.token_ids[:2] == cached.token_ids
    assert_matches(hf_model, prompt, got)
    engine.scheduler.check_no_leaks()


def test_only_asking_requests_get_them(hf_dir: Path) -> None:
    ids, _ = cases()["text_only"]
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=8))
    asking, plain = engine.generate([Prompt(token_ids=ids)] * 2,
                                    [SamplingParams(max_new_tokens=4, top_logprobs=2),
                                     SamplingParams(max_new_tokens=4)])
    assert [len(t.token_ids) for t in asking.top_logprobs] == [2] * len(asking.token_ids)
    assert asking.prompt_logprobs == [] and plain.top_logprobs == [] == plain.prompt_logprobs
    assert asking.token_ids == plain.token_ids
    engine.scheduler.check_no_leaks()


def test_top_logprobs_rows() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    got = top_logprobs(logits, [0, 3, 0, 1])
    assert got[0] is None and got[2] is None
    ref = torch.log_softmax(logits, dim=-1)
    for row, k in ((1, 3), (3, 1)):
        top = got[row]
        assert top is not None
        values, ids = ref[row].topk(k)
        assert list(top.token_ids) == ids.tolist()
        torch.testing.assert_close(torch.tensor(top.logprobs), values)
    assert top_logprobs(logits, [0] * 4) == [None] * 4


@pytest.mark.parametrize("field,value", [("top_logprobs", 21), ("top_logprobs", -1),
                                         ("prompt_logprobs", 21), ("prompt_logprobs", -1)])
def test_out_of_range_counts_are_refused(field: str, value: int) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validate()
