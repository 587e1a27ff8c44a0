"""Structured outputs through the engine's step (engine/sampling/structured.py) on the built-in
model: every output satisfies its grammar and, wherever the model's own next token (its raw
top-1, the step's unconstrained greedy pick) was allowed, is that token; EAGLE's chain and tree
rounds commit exactly what plain decoding does under the same grammar; a resumed request and a
cancelled one behave.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.builtin import builtin_hybrid_model_dir, builtin_model_dir
from engine.config import EngineConfig
from engine.core.request import FinishReason, SamplingParams
from engine.errors import InvalidRequestError
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from engine.models.eagle.loader import load_draft
from engine.sampling.grammar import GrammarCompiler, GrammarSpec
from tests.structured_schemas import MAX_TOKENS, SCHEMAS, check_json

BUILTIN = builtin_model_dir()
PROMPT = Prompt(text="config = ")
OTHER_SPECS = {  # (kind, value) beside the schemas: how each output is checked
    "regex": ("regex", r"[a-z]{2,6}-[0-9]{1,3}"),
    "choice": ("choice", json.dumps(["import os", "from sys import path", "pass"])),
    "json_object": ("json_object", ""),
    "grammar": ("grammar", 'root ::= "def " name "(" name? ")"\nname ::= [a-z_]{1,8}'),
}


def specs(*, bounded: bool = False) -> dict[str, tuple[str, str]]:
    """Every grammar of the suite as ``(kind, value)``; ``bounded``: only those whose language
    is finite (not ``json_object``, whose strings a sampled output may never close)."""
    out = {name: ("json_schema", json.dumps(schema)) for name, schema in SCHEMAS.items()}
    out.update(OTHER_SPECS)
    if bounded:
        del out["json_object"]
    return out


def check_output(name: str, text: str) -> None:
    """``text`` (the output without its stop token) satisfies grammar ``name``."""
    if name in SCHEMAS:
        check_json(text, SCHEMAS[name])
    elif name == "regex":
        assert re.fullmatch(OTHER_SPECS["regex"][1], text), text
    elif name == "choice":
        assert text in json.loads(OTHER_SPECS["choice"][1]), text
    elif name == "json_object":
        assert isinstance(json.loads(text), dict), text
    else:
        assert re.fullmatch(r"def [a-z_]{1,8}\(([a-z_]{1,8})?\)", text), text


def params(spec: tuple[str, str], **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_TOKENS, structured_output=spec, top_logprobs=1,
                          **kw)  # type: ignore[arg-type]


def text_of(engine: LLMEngine, result: GenerationResult) -> str:
    """The output's text without its final stop token."""
    assert result.finish_reason == FinishReason.STOP, (result.finish_reason, result.text)
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(result.token_ids[:-1])


def assert_follows_the_model(compiler: GrammarCompiler, spec: tuple[str, str],
                             result: GenerationResult) -> None:
    """Each output token is allowed by the grammar, and is the model's own top-1 (the raw
    logits' argmax, from ``top_logprobs``) whenever the grammar allowed that."""
    matcher = compiler.matcher(GrammarSpec.parse(*spec))
    bitmask = compiler.allocate_bitmask(1)
    followed = 0
    for i, (token, top) in enumerate(zip(result.token_ids, result.top_logprobs, strict=True)):
        matcher.fill_bitmask(bitmask)
        best = top.token_ids[0]
        if int(bitmask[0, best // 32]) & (1 << (best % 32)):
            assert token == best, f"position {i}: {token} though the model's {best} was allowed"
            followed += 1
        assert matcher.accept(token), f"position {i}: token {token} is not allowed"
    assert matcher.is_terminated()


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(BUILTIN, EngineConfig(num_pages=512, page_size=16, max_num_seqs=32))


@pytest.fixture(scope="module")
def greedy(engine: LLMEngine) -> dict[str, GenerationResult]:
    """Every grammar's greedy output, all in one batch."""
    grammars = specs()
    results = engine.generate([PROMPT] * len(grammars), [params(s) for s in grammars.values()])
    engine.scheduler.check_no_leaks()
    return dict(zip(grammars, results, strict=True))


def test_greedy_outputs_satisfy_their_grammar_and_follow_the_model(
        engine: LLMEngine, greedy: dict[str, GenerationResult]) -> None:
    assert len(SCHEMAS) >= 20
    compiler = engine.structured.compiler()
    for name, spec in specs().items():
        check_output(name, text_of(engine, greedy[name]))
        assert_follows_the_model(compiler, spec, greedy[name])


def test_the_grammar_changes_the_output_and_logprobs_stay_the_models(
        engine: LLMEngine, greedy: dict[str, GenerationResult]) -> None:
    """Constrained tokens the model did not prefer still report the model's log-probability,
    which equals an unconstrained request's alternatives at the same position."""
    [free] = engine.generate([PROMPT], SamplingParams(max_new_tokens=4, top_logprobs=5))
    out = greedy["flat object"]
    assert out.token_ids[0] != free.token_ids[0]  # the model does not start with "{" here
    alternatives = dict(zip(*free.top_logprobs[0], strict=True))
    if out.token_ids[0] in alternatives:
        assert out.logprobs[0] == pytest.approx(alternatives[out.token_ids[0]], abs=1e-5)
    assert out.logprobs[0] < free.logprobs[0]


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_outputs_satisfy_their_grammar(engine: LLMEngine, seed: int) -> None:
    grammars = specs(bounded=True)
    sampling = [params(s, temperature=1.0, top_p=0.95, seed=seed + i)
                for i, s in enumerate(grammars.values())]
    results = engine.generate([PROMPT] * len(grammars), sampling)
    for name, result in zip(grammars, results, strict=True):
        check_output(name, text_of(engine, result))
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("shape", [TreeShape(4), TreeShape(4, 2, 3)], ids=["chain", "tree"])
def test_eagle_rounds_commit_what_plain_decoding_does(
        greedy: dict[str, GenerationResult], shape: TreeShape) -> None:
    """The verify rows are masked, so accepted drafts and the bonus token are the plain
    constrained tokens, at every round; sampled rounds satisfy the grammar too."""
    engine = LLMEngine(BUILTIN, EngineConfig(num_pages=512, page_size=16, max_num_seqs=32,
                                             lookahead_tokens=shape.lookahead))
    draft = load_draft(BUILTIN / "draft", engine.model_config.text, torch.float32)
    spec = EagleEngine(engine, draft, shape.num_draft_tokens, shape.topk, shape.steps)
    grammars = specs()
    reqs = {name: engine.add_request(engine.prepare(PROMPT).token_ids, sampling=params(s))
            for name, s in grammars.items()}
    sampled = {name: engine.add_request(engine.prepare(PROMPT).token_ids,
                                        sampling=params(s, temperature=0.8, seed=7))
               for name, s in specs(bounded=True).items()}
    while engine.scheduler.has_unfinished():
        spec.step()
    for name, req in reqs.items():
        assert req.output_token_ids == greedy[name].token_ids, name
    for name, req in sampled.items():
        check_output(name, text_of(engine, engine.result(req)))
    assert spec.stats.accepted > 0
    engine.scheduler.check_no_leaks()


def test_resumed_output_is_replayed_into_the_grammar(
        engine: LLMEngine, greedy: dict[str, GenerationResult]) -> None:
    """A request resubmitted after a failover (its output so far at the end of its prompt,
    ``resumed_tokens``) goes on exactly where the original would have."""
    name = "nested objects"
    done = greedy[name].token_ids
    prompt = engine.prepare(PROMPT).token_ids + done[:5]
    [resumed] = engine.generate([Prompt(token_ids=prompt)],
                                params(specs()[name], resumed_tokens=5))
    assert resumed.token_ids == done[5:]


def test_cancelled_constrained_requests_leave_nothing_held(engine: LLMEngine) -> None:
    reqs = [engine.add_request(engine.prepare(PROMPT).token_ids, sampling=params(s))
            for s in specs().values()]
    while not all(r.num_output_tokens > 1 for r in reqs):
        engine.step()
    assert all(r.grammar is not None for r in reqs)
    for r in reqs:
        engine.abort(r.request_id)
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize(("spec", "message"), [
    (("json_schema", "{not json"), "json_schema is not valid JSON"),
    (("json_schema", json.dumps({"type": "object", "not": {"required": ["a"]}})),
     "'not' at # is not supported"),
    (("regex", "(?<=a)b"), "invalid regex"),
    (("choice", "[]"), "choice must be a non-empty list"),
    (("yaml", "a: 1"), "unknown structured output kind 'yaml'"),
])
def test_grammars_that_cannot_be_served_are_refused_naming_the_problem(
        engine: LLMEngine, spec: tuple[str, str], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        engine.add_request([1, 2, 3], sampling=SamplingParams(structured_output=spec))
    engine.scheduler.check_no_leaks()


def test_ignore_eos_with_a_grammar_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="ignore_eos cannot be combined"):
        engine.add_request([1, 2, 3], sampling=SamplingParams(
            structured_output=("json_object", ""), ignore_eos=True))


def test_a_model_without_tokenizer_refuses_grammars(tiny_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    (model / "tokenizer.json").unlink(missing_ok=True)
    engine = LLMEngine(model, EngineConfig(num_pages=8, page_size=8))
    with pytest.raises(InvalidRequestError, match="need the model's tokenizer.json"):
        engine.add_request([1, 2, 3], sampling=SamplingParams(
            structured_output=("json_object", "")))


def test_a_hybrid_model_with_its_mtp_head_commits_what_plain_decoding_does() -> None:
    """The built-in Qwen3.5-shaped model (linear-attention layers, MTP head): plain constrained
    decoding and MTP rounds under the same grammars give the same valid outputs."""
    model = builtin_hybrid_model_dir()
    grammars = specs()
    prompts = [PROMPT] * len(grammars)
    config = EngineConfig(num_pages=512, page_size=16, max_num_seqs=32, lookahead_tokens=3)
    plain = LLMEngine(model, config)
    want = plain.generate(prompts, [params(s) for s in grammars.values()])
    engine = LLMEngine(model, config, draft="mtp")
    spec = EagleEngine(engine, engine.load_draft(), 3)
    reqs = [engine.add_request(engine.prepare(PROMPT).token_ids, sampling=params(s))
            for s in grammars.values()]
    while engine.scheduler.has_unfinished():
        spec.step()
    for name, result, req in zip(grammars, want, reqs, strict=True):
        check_output(name, text_of(plain, result))
        assert req.output_token_ids == result.token_ids, name
    assert spec.stats.accepted > 0
    engine.scheduler.check_no_leaks()
