"""The shipped built-in model (``engine/builtin/tiny-qwen2-vl``, made by ``scripts/train_tiny.py``):
it loads, continues Python-like prompts deterministically and not degenerately, its EAGLE draft
loads and speculative decoding with it equals plain decoding while accepting more than one token
per round, and everything shipped stays small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine
from decode_node.spec.eagle_engine import EagleEngine
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.loader import load_draft
from engine.text.chat import chat_prompt

BUILTIN = Path(engine.__file__).parent / "builtin" / "tiny-qwen2-vl"
MAX_BYTES = 20 * 1024 * 1024
K = 4
# From the standard library's heapq.py, a file scripts/train_tiny.py holds out of training.
HELD_OUT_PROMPT = '''def heappush(heap, item):
    """Push item onto heap, maintaining the heap invariant."""
    heap.append(item)
    _siftdown(heap, 0, len(heap)-1)

def heappop(heap):
    """Pop the smallest item off the heap, maintaining the heap invariant."""
'''

pytestmark = pytest.mark.skipif(not (BUILTIN / "config.json").is_file(),
                                reason="the built-in model is not shipped in this checkout")


@pytest.fixture(scope="module")
def engine_() -> LLMEngine:
    return LLMEngine(BUILTIN, EngineConfig(num_pages=256, page_size=16))


def test_shipped_files_are_complete_and_small() -> None:
    names = {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
             "preprocessor_config.json", "TRAINING.md", "draft/config.json",
             "draft/model.safetensors"}
    files = [p for p in BUILTIN.rglob("*") if p.is_file()]
    assert names <= {str(p.relative_to(BUILTIN)) for p in files}
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES


def test_greedy_continuation_is_deterministic_and_not_degenerate(engine_: LLMEngine) -> None:
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    # "def fibonacci(n):" is not used: this small model drifts into "_get_get_get" there
    prompts = [Prompt(text="import os\n"), Prompt(text="    def __init__(self")]
    first = engine_.generate(prompts, params)
    again = engine_.generate(prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    for result in first:
        assert len(result.token_ids) == 32
        assert len(set(result.token_ids)) >= 8, result.text  # not one token repeated
        assert result.text and any(c.isalpha() for c in result.text)


def test_chat_requests_for_a_function_get_a_def_back(engine_: LLMEngine) -> None:
    """The chat turns in the training corpus taught the format: a request for a function is
    answered with Python that starts with ``def``."""
    asks = ["Write a Python function fibonacci(n). Return the n-th Fibonacci number.",
            "Write a Python function read_lines(path). Return the lines of the file at path."]
    results = engine_.generate([Prompt(text=chat_prompt(a)) for a in asks],
                               SamplingParams(max_new_tokens=24))
    for result in results:
        assert result.text.startswith("def "), result.text
        assert "(" in result.text.splitlines()[0] and result.text.splitlines()[0].endswith(":")


def test_eagle_on_the_shipped_pair_equals_plain_and_accepts_drafts(engine_: LLMEngine) -> None:
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    prompt = [Prompt(text=HELD_OUT_PROMPT)]
    [plain] = engine_.generate(prompt, params)
    spec_engine = LLMEngine(BUILTIN, EngineConfig(num_pages=256, page_size=16,
                                                  lookahead_tokens=K))
    draft = load_draft(BUILTIN / "draft", spec_engine.model_config.text, torch.float32)
    spec = EagleEngine(spec_engine, draft, K)
    [got] = spec.generate(prompt, params)
    assert got.token_ids == plain.token_ids
    assert spec.stats.acceptance_length >= 2.5, spec.stats  # the bar at K = 4
    spec_engine.scheduler.check_no_leaks()
