"""Bad requests get a clear :class:`InvalidRequestError` and leave the engine serving.

Every case runs on our tiny model and on a transformers-written checkpoint (which has no
tokenizer). After each refusal the scheduler holds nothing, and the same engine still answers a
valid request exactly as it did before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput

MAX_LEN = 64
PATCH_DIM = 3 * 2 * 14 * 14
GOOD = SamplingParams(max_new_tokens=4, ignore_eos=True)


@dataclass
class Served:
    """An engine with the answers it gave to two valid requests before any bad one."""

    engine: LLMEngine
    cfg: ModelConfig
    text_answer: list[int]
    image_answer: list[int]
    has_tokenizer: bool


def image(grid: tuple[int, int, int], seed: int = 0, rows: int | None = None) -> ImageInput:
    gen = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1] * grid[2] if rows is None else rows
    return ImageInput(torch.randn(n, PATCH_DIM, generator=gen), grid)


def image_prompt(cfg: ModelConfig, n_image_tokens: int) -> list[int]:
    return [1, 2, cfg.vision_start_token_id, *[cfg.image_token_id] * n_image_tokens,
            cfg.vision_end_token_id, 3]


def valid_text(served: Served) -> list[int]:
    [res] = served.engine.generate([Prompt(token_ids=[5, 6, 7, 8])], GOOD)
    return res.token_ids


def valid_image(served: Served) -> list[int]:
    ids = image_prompt(served.cfg, 4)
    [res] = served.engine.generate([Prompt(token_ids=ids, images=[image((1, 4, 4))])], GOOD)
    return res.token_ids


@pytest.fixture(scope="module", params=["tiny_dir", "hf_dir"])
def served(request: pytest.FixtureRequest) -> Served:
    model_dir: Path = request.getfixturevalue(request.param)
    engine = LLMEngine(model_dir, EngineConfig(num_pages=64, page_size=16, max_model_len=MAX_LEN))
    s = Served(engine, engine.model_config, [], [], engine.tokenizer is not None)
    s.text_answer, s.image_answer = valid_text(s), valid_image(s)
    assert len(s.text_answer) == len(s.image_answer) == GOOD.max_new_tokens
    engine.scheduler.check_no_leaks()
    return s


def add(s: Served, ids: list[int], images: list[ImageInput] | None = None,
        sampling: SamplingParams = GOOD) -> None:
    s.engine.add_request(ids, images or [], sampling)


def gen_text(s: Served, text: str, images: list[ImageInput] | None = None) -> None:
    s.engine.generate([Prompt(text=text, images=images or [])], GOOD)


# name -> (what to do, a word the message must contain)
CASES: dict[str, tuple[Callable[[Served], None], str]] = {
    "empty_prompt_add_request": (lambda s: add(s, []), "empty"),
    "empty_prompt_generate": (
        lambda s: s.engine.generate([Prompt(token_ids=[])], GOOD), "empty"),
    "prompt_longer_than_context": (lambda s: add(s, [1] * 100), "max_model_len"),
    "prompt_plus_new_tokens_over_context": (
        lambda s: add(s, [1] * 60, sampling=SamplingParams(max_new_tokens=5)), "max_model_len"),
    "token_id_equal_to_vocab_size": (
        lambda s: add(s, [1, s.cfg.text.vocab_size, 2]), "vocabulary"),
    "negative_token_id": (lambda s: add(s, [1, -1, 2]), "vocabulary"),
    "huge_token_id": (lambda s: add(s, [2**40]), "vocabulary"),
    "too_many_image_tokens": (
        lambda s: add(s, image_prompt(s.cfg, 5), [image((1, 4, 4))]), "image tokens"),
    "too_few_image_tokens": (
        lambda s: add(s, image_prompt(s.cfg, 3), [image((1, 4, 4))]), "image tokens"),
    "image_tokens_without_image": (lambda s: add(s, image_prompt(s.cfg, 4)), "image tokens"),
    "image_without_image_tokens": (lambda s: add(s, [1, 2, 3], [image((1, 4, 4))]), "image"),
    "two_images_one_run": (
        lambda s: add(s, image_prompt(s.cfg, 4), [image((1, 4, 4)), image((1, 2, 2))]),
        "images"),
    "patches_with_too_few_rows": (
        lambda s: add(s, image_prompt(s.cfg, 4), [image((1, 4, 4), rows=15)]), "patches"),
    "patches_with_wrong_width": (
        lambda s: add(s, image_prompt(s.cfg, 4),
                      [ImageInput(torch.zeros(16, PATCH_DIM - 1), (1, 4, 4))]), "patches"),
    "patches_of_wrong_rank": (
        lambda s: add(s, image_prompt(s.cfg, 4),
                      [ImageInput(torch.zeros(16 * PATCH_DIM), (1, 4, 4))]), "patches"),
    "grid_not_multiple_of_merge": (
        lambda s: add(s, image_prompt(s.cfg, 3), [image((1, 3, 4))]), "multiples"),
    "grid_with_zero": (lambda s: add(s, image_prompt(s.cfg, 1), [image((0, 2, 2))]), "grid"),
    "undecodable_image_bytes": (
        lambda s: s.engine.prepare(Prompt(token_ids=[1], images=[b"garbage"])), "decode"),
    "empty_image_bytes": (
        lambda s: s.engine.prepare(Prompt(token_ids=[1], images=[b""])), "empty"),
    "negative_temperature": (
        lambda s: add(s, [1, 2], sampling=SamplingParams(temperature=-0.5)), "temperature"),
    "nan_temperature": (
        lambda s: add(s, [1, 2], sampling=SamplingParams(temperature=float("nan"))),
        "temperature"),
    "top_p_zero": (lambda s: add(s, [1, 2], sampling=SamplingParams(top_p=0.0)), "top_p"),
    "top_p_above_one": (lambda s: add(s, [1, 2], sampling=SamplingParams(top_p=1.5)), "top_p"),
    "negative_top_k": (lambda s: add(s, [1, 2], sampling=SamplingParams(top_k=-1)), "top_k"),
    "max_new_tokens_zero": (
        lambda s: add(s, [1, 2], sampling=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    "stop_token_outside_vocab": (
        lambda s: add(s, [1, 2], sampling=SamplingParams(stop_token_ids=(10**6,))), "stop"),
    "both_text_and_token_ids": (
        lambda s: s.engine.prepare(Prompt(text="hi", token_ids=[1])), "exactly one"),
    "neither_text_nor_token_ids": (
        lambda s: s.engine.prepare(Prompt()), "exactly one"),
}

# Cases that need a tokenizer (tiny model only).
TEXT_CASES: dict[str, tuple[Callable[[Served], None], str]] = {
    "empty_text": (lambda s: gen_text(s, ""), "empty"),
    "more_placeholders_than_images": (
        lambda s: s.engine.prepare(Prompt(
            text="<|vision_start|><|image_pad|><|vision_end|>a<|vision_start|><|image_pad|>"
                 "<|vision_end|> b", images=[image((1, 4, 4))])),
        "placeholders"),
    "placeholder_without_image": (
        lambda s: gen_text(s, "look <|vision_start|><|image_pad|><|vision_end|>"), "placeholders"),
    "text_longer_than_context": (lambda s: gen_text(s, "word " * 200), "max_model_len"),
}


def check_still_serving(s: Served) -> None:
    s.engine.scheduler.check_no_leaks()
    assert valid_text(s) == s.text_answer
    assert valid_image(s) == s.image_answer
    s.engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_is_refused_and_engine_keeps_serving(name: str, served: Served) -> None:
    action, word = CASES[name]
    with pytest.raises(InvalidRequestError, match=word):
        action(served)
    check_still_serving(served)


@pytest.mark.parametrize("name", list(TEXT_CASES))
def test_bad_text_prompt_is_refused(name: str, served: Served) -> None:
    if not served.has_tokenizer:
        pytest.skip("this checkpoint has no tokenizer.json")
    action, word = TEXT_CASES[name]
    with pytest.raises(InvalidRequestError, match=word):
        action(served)
    check_still_serving(served)


def test_text_prompt_without_tokenizer_asks_for_token_ids(served: Served) -> None:
    if served.has_tokenizer:
        pytest.skip("this checkpoint has a tokenizer.json")
    with pytest.raises(InvalidRequestError, match="token_ids"):
        served.engine.generate([Prompt(text="hello")], GOOD)
    check_still_serving(served)


def test_prompt_at_exactly_the_context_limit_is_served(served: Served) -> None:
    [res] = served.engine.generate([Prompt(token_ids=[1] * (MAX_LEN - 4))], GOOD)
    assert len(res.token_ids) == 4
    check_still_serving(served)


@pytest.mark.parametrize("model", ["tiny_dir", "hf_dir"])
def test_default_context_is_the_models_max_position_embeddings(
    model: str, request: pytest.FixtureRequest
) -> None:
    engine = LLMEngine(request.getfixturevalue(model), EngineConfig(num_pages=64))
    limit = engine.model_config.text.max_position_embeddings
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request([1] * (limit + 1), sampling=SamplingParams(max_new_tokens=1))
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("model", ["tiny_dir", "hf_dir"])
def test_batch_with_one_bad_prompt_leaves_nothing_queued(
    model: str, request: pytest.FixtureRequest
) -> None:
    engine = LLMEngine(request.getfixturevalue(model), EngineConfig(num_pages=64))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate([Prompt(token_ids=[1, 2, 3]), Prompt(token_ids=[])], GOOD)
    engine.scheduler.check_no_leaks()
