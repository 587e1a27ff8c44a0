"""Structured outputs (engine/sampling/grammar.py) on the built-in model's byte-level tokenizer.

The central check samples from seeded random logits masked by each grammar until the matcher
terminates, then validates the decoded text: JSON against its schema (``jsonschema``), regex and
choice outputs by matching. The random logits lean towards closing tokens and EOS so that outputs
end well within the cap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import tokenizers
import torch

from engine.builtin import builtin_model_dir
from engine.errors import InvalidRequestError
from engine.sampling.grammar import (
    MAX_JSON_WHITESPACE,
    GrammarCompiler,
    GrammarMatcher,
    GrammarSpec,
    apply_mask,
)

TOKENIZER = builtin_model_dir() / "tokenizer.json"
EOS = 2043  # <|im_end|>; <|endoftext|> (2041) is the checkpoint's other EOS
MAX_TOKENS = 600  # cap of one sampled output
PADDED_VOCAB = 2048 + 37  # a model vocabulary wider than the tokenizer's, not a multiple of 32

pytestmark = pytest.mark.skipif(not TOKENIZER.is_file(), reason="no built-in tokenizer")


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    built = GrammarCompiler.from_model_dir(builtin_model_dir())
    assert built is not None
    return built


@pytest.fixture(scope="module")
def bias(tokenizer: tokenizers.Tokenizer, compiler: GrammarCompiler) -> torch.Tensor:
    """``[V]``: +2 for tokens that close something (``}``, ``]``, ``"``), +4 for the EOS ids."""
    out = torch.zeros(compiler.vocab_size)
    for token_id in range(compiler.vocab_size):
        if any(c in tokenizer.decode([token_id]) for c in '}]"'):
            out[token_id] = 2.0
    out[list(compiler.stop_token_ids)] = 4.0
    return out


def token(tokenizer: tokenizers.Tokenizer, spelling: str) -> int:
    """The id of the token spelled ``spelling`` (byte-level: "Ġ" is a space)."""
    token_id = tokenizer.token_to_id(spelling)
    assert token_id is not None, spelling
    return token_id


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    """The token ids ``bitmask[row]`` allows."""
    logits = torch.zeros(1, vocab_size)
    apply_mask(logits, bitmask[row:row + 1])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def mask_of(matcher: GrammarMatcher, vocab_size: int) -> set[int]:
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(bitmask)
    return allowed(bitmask, 0, vocab_size)


def generate(compiler: GrammarCompiler, matcher: GrammarMatcher, bias: torch.Tensor,
             seed: int) -> list[int]:
    """Sample from seeded random logits under the grammar until the matcher terminates; every
    sampled token must be accepted (the mask never allows what the matcher refuses)."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = compiler.allocate_bitmask(1)
    ids: list[int] = []
    while not matcher.is_terminated():
        assert len(ids) < MAX_TOKENS, "the output did not end within the cap"
        matcher.fill_bitmask(bitmask)
        logits = torch.randn(1, compiler.vocab_size, generator=gen) * 2.0 + bias  # [1, V]
        apply_mask(logits, bitmask)
        token_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert matcher.accept(token_id), f"the mask allowed {token_id} but the matcher refused it"
        ids.append(token_id)
    return ids


def sample_text(compiler: GrammarCompiler, tokenizer: tokenizers.Tokenizer, bias: torch.Tensor,
                spec: GrammarSpec, seed: int) -> str:
    """One sampled output's text, without its stop token."""
    ids = generate(compiler, compiler.matcher(spec), bias, seed)
    assert ids[-1] in compiler.stop_token_ids
    return tokenizer.decode(ids[:-1])


# ---- outputs satisfy their grammar ---------------------------------------------------------------

SCHEMAS: dict[str, Any] = {
    "flat object": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
    "nested objects": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"},
            "address": {"type": "object", "properties": {"zip": {"type": "string",
                                                                  "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"]}},
            "required": ["id", "address"]}},
        "required": ["user"]},
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
    "string enum": {"enum": ["red", "green", "blue"]},
    "mixed enum": {"enum": [1, "a", None, True, {"x": [1, 2]}]},
    "integer range": {"type": "integer", "minimum": -5, "maximum": 120},
    "exclusive integer range": {"type": "integer", "exclusiveMinimum": 0,
                                "exclusiveMaximum": 10},
    "number range": {"type": "number", "minimum": -1.5, "maximum": 2.5},
    "multipleOf": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 1000},
    "string pattern": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}-[0-9]{2}$"},
    "string lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4},
                        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    "disjoint oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "nullable type list": {"type": "object", "properties": {"v": {"type": ["string", "null"],
                                                                  "maxLength": 3}},
                           "required": ["v"]},
    "optional fields": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4},
        "c": {"type": "boolean"}}, "required": ["b"]},
    "additionalProperties false": {"type": "object", "properties": {"k": {"type": "integer"}},
                                   "required": ["k"], "additionalProperties": False},
    "additionalProperties schema": {"type": "object", "maxProperties": 2,
                                    "additionalProperties": {"type": "integer"}},
    "defs and ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                         "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"]},
    "recursive tree": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}, "$ref": "#/$defs/node"},
    "const": {"const": {"version": 2, "tags": ["a", "b"]}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"},
                                                     {"type": "boolean"}],
                    "items": False, "minItems": 3},
    "formats": {"type": "object", "properties": {  # (xgrammar's ipv4 admits "01": not here)
        "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}},
                "required": ["day", "id"]},
    "nested arrays": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "number"}}},
    "pydantic style": {"title": "Reply", "type": "object", "properties": {
        "answer": {"title": "Answer", "description": "the answer", "type": "string",
                   "maxLength": 6},
        "score": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}},
        "required": ["answer"]},
    "any JSON": True,
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_outputs_satisfy_their_json_schema(
        name: str, compiler: GrammarCompiler, tokenizer: tokenizers.Tokenizer,
        bias: torch.Tensor) -> None:
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for seed in range(3):
        text = sample_text(compiler, tokenizer, bias, GrammarSpec.json_schema(schema), seed)
        validator.validate(json.loads(text))


def test_json_object_outputs_are_objects(compiler: GrammarCompiler,
                                         tokenizer: tokenizers.Tokenizer,
                                         bias: torch.Tensor) -> None:
    for seed in range(5):
        text = sample_text(compiler, tokenizer, bias, GrammarSpec.json_object(), seed)
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)",
                                     r"(yes|no)", r"-?(0|[1-9]\d{0,5})(\.\d{1,3})?",
                                     r"[A-Z][a-z ]{0,10}\."])
def test_regex_outputs_match(pattern: str, compiler: GrammarCompiler,
                             tokenizer: tokenizers.Tokenizer, bias: torch.Tensor) -> None:
    for seed in range(3):
        text = sample_text(compiler, tokenizer, bias, GrammarSpec.regex(pattern), seed)
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_one_of_the_options(compiler: GrammarCompiler,
                                               tokenizer: tokenizers.Tokenizer,
                                               bias: torch.Tensor) -> None:
    options = ("positive", "negative", 'say "hi"', "back\\slash", "two\nlines", "café")
    spec = GrammarSpec.choice(options)
    seen = {sample_text(compiler, tokenizer, bias, spec, seed) for seed in range(12)}
    assert seen <= set(options) and len(seen) > 1


def test_ebnf_outputs_match(compiler: GrammarCompiler, tokenizer: tokenizers.Tokenizer,
                            bias: torch.Tensor) -> None:
    spec = GrammarSpec.ebnf('root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]*')
    for seed in range(3):
        text = sample_text(compiler, tokenizer, bias, spec, seed)
        assert re.fullmatch(r"\([1-9][0-9]*(\+[1-9][0-9]*)*\)", text), text


# ---- refusals --------------------------------------------------------------------------------

INVALID: list[tuple[Callable[[], GrammarSpec], str]] = [
    (lambda: GrammarSpec("xml", "<a/>"), "unknown structured output kind 'xml'"),
    (lambda: GrammarSpec.json_schema("{not json"), "json_schema is not valid JSON"),
    (lambda: GrammarSpec.json_schema("[1, 2]"), "json_schema must be a JSON object"),
    (lambda: GrammarSpec.json_schema({"type": "object", "properties": {"tags": {
        "type": "array", "uniqueItems": True}}}), "'uniqueItems' at #/properties/tags"),
    (lambda: GrammarSpec.json_schema({"type": "integer", "not": {"const": 3}}), "'not' at #"),
    (lambda: GrammarSpec.json_schema({"type": "object", "if": {"required": ["a"]},
                                      "then": {"required": ["b"]}}), "'if' at #"),
    (lambda: GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"},
                                      "contains": {"const": 1}}), "'contains' at #"),
    (lambda: GrammarSpec.json_schema({"$defs": {"a/b": {"dependentRequired": {"x": ["y"]}}},
                                      "$ref": "#/$defs/a~1b"}),
     "'dependentRequired' at #/$defs/a~1b"),
    (lambda: GrammarSpec.json_schema({"allOf": [{"type": "integer"}, {"minimum": 3}]}),
     "'allOf' with more than one member at #"),
    (lambda: GrammarSpec.json_schema({"$ref": "https://example.com/s.json"}),
     "the external '$ref' 'https://example.com/s.json' at #"),
    (lambda: GrammarSpec.json_schema({"type": "object", "properties": {"p": {
        "type": "string", "pattern": "^(?=a)a+$"}}}),
     "the pattern '^(?=a)a+$' at #/properties/p is not supported: Regex parsing error"),
    (lambda: GrammarSpec.json_schema({"type": "string", "pattern": "^a+$", "maxLength": 3}),
     "'minLength'/'maxLength' together with 'pattern' or 'format' at #"),
    (lambda: GrammarSpec.json_schema({"$ref": "#/$defs/missing"}), "Cannot find field '$defs'"),
    (lambda: GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
     "minimum greater than maximum"),
    (lambda: GrammarSpec.json_schema({"type": "foo"}), 'Unsupported type "foo"'),
    (lambda: GrammarSpec.regex("a(("), "invalid regex: Regex parsing error at position 4: "
                                        "The parenthesis is not closed."),
    (lambda: GrammarSpec.regex(r"(a)\1"), "Backreference is not supported"),
    (lambda: GrammarSpec.regex(""), "regex is empty"),
    (lambda: GrammarSpec.choice([]), "choice must be a non-empty list of strings"),
    (lambda: GrammarSpec.choice(["a", ""]), "choice options must be non-empty strings"),
    (lambda: GrammarSpec.parse("choice", '{"a": 1}'), "choice must be a non-empty list"),
    (lambda: GrammarSpec("json_object", "{}"), "json_object takes no value"),
    (lambda: GrammarSpec.json_schema("[" * 100_000), "json_schema is nested too deeply"),
    (lambda: GrammarSpec.ebnf("root ::= x"), 'invalid grammar: EBNF parser error at line 1, '
                                             'column 10: Rule "x" is not defined'),
]


@pytest.mark.parametrize(("make", "message"), INVALID)
def test_unservable_specs_raise_invalid_request_naming_the_problem(
        make: Callable[[], GrammarSpec], message: str, compiler: GrammarCompiler) -> None:
    try:
        spec = make()
    except InvalidRequestError as exc:  # a bad shape: refused on construction
        assert message in str(exc)
        return
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        spec.validate()
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        compiler.compiled(spec)


def test_unenforced_keywords_inside_property_names_and_values_are_fine(
        compiler: GrammarCompiler) -> None:
    """Only keywords count: a property called "not" or an enum value "if" is no refusal."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {
        "not": {"enum": ["if", "contains"]}, "contains": {"const": {"not": 1}}}})
    compiler.compiled(spec)


# ---- state: rollback, replay, EOS, speculative verification ---------------------------------


@pytest.fixture(scope="module")
def trajectory(compiler: GrammarCompiler, bias: torch.Tensor) -> tuple[GrammarSpec, list[int]]:
    """A spec and one complete sampled output of it (stop token included)."""
    spec = GrammarSpec.json_schema(SCHEMAS["nested objects"])
    return spec, generate(compiler, compiler.matcher(spec), bias, seed=7)


def test_rollback_restores_the_mask(compiler: GrammarCompiler,
                                    trajectory: tuple[GrammarSpec, list[int]]) -> None:
    spec, ids = trajectory
    matcher = compiler.matcher(spec)
    masks = []
    for token_id in ids:
        masks.append(mask_of(matcher, compiler.vocab_size))
        assert matcher.accept(token_id)
    assert matcher.is_terminated() and matcher.num_tokens == len(ids)
    for k in (1, 3, len(ids) // 2):
        matcher.rollback(k)
        assert not matcher.is_terminated()
        assert mask_of(matcher, compiler.vocab_size) == masks[len(ids) - k]
        matcher.replay(ids[len(ids) - k:])
        assert matcher.is_terminated()
    matcher.rollback(len(ids))
    assert matcher.num_tokens == 0 and mask_of(matcher, compiler.vocab_size) == masks[0]
    with pytest.raises(ValueError, match="cannot roll back 1 of 0"):
        matcher.rollback(1)


def test_replay_on_a_fresh_matcher_gives_the_live_mask(
        compiler: GrammarCompiler, trajectory: tuple[GrammarSpec, list[int]]) -> None:
    """The decode node rebuilds the state from the tokens generated so far."""
    spec, ids = trajectory
    live = compiler.matcher(spec)
    for n, token_id in enumerate(ids[:-1]):
        if n % 5 == 0:
            rebuilt = compiler.matcher(spec, generated=ids[:n])
            assert rebuilt.num_tokens == n
            assert mask_of(rebuilt, compiler.vocab_size) == mask_of(live, compiler.vocab_size)
        assert live.accept(token_id)
    assert compiler.matcher(spec, generated=ids).is_terminated()


def test_replay_of_a_refused_token_raises_and_leaves_the_state(
        compiler: GrammarCompiler, trajectory: tuple[GrammarSpec, list[int]]) -> None:
    spec, ids = trajectory
    matcher = compiler.matcher(spec, generated=ids[:2])
    before = mask_of(matcher, compiler.vocab_size)
    refused = next(t for t in range(compiler.vocab_size) if t not in before)
    with pytest.raises(InvalidRequestError, match=f"output token {refused} \\(position 3\\)"):
        matcher.replay([*ids[2:5], refused])
    assert matcher.num_tokens == 2 and mask_of(matcher, compiler.vocab_size) == before
    with pytest.raises(InvalidRequestError, match="does not satisfy"):
        compiler.matcher(spec, generated=[refused])


def test_complete_output_allows_only_stop_tokens_then_terminates(
        compiler: GrammarCompiler, tokenizer: tokenizers.Tokenizer) -> None:
    spec = GrammarSpec.choice(["ok"])
    matcher = compiler.matcher(spec, extra_stop_ids=[31])  # the request's own (bit 31 of a word)
    assert matcher.accept(token(tokenizer, "ok"))
    assert mask_of(matcher, compiler.vocab_size) == {EOS, 2041, 31}
    assert matcher.accept(EOS) and matcher.is_terminated()
    assert mask_of(matcher, compiler.vocab_size) == {EOS, 2041, 31}  # terminated: stops only
    assert not matcher.accept(EOS) and matcher.num_tokens == 2
    with pytest.raises(InvalidRequestError, match="stop token id 2048 is outside"):
        compiler.matcher(spec, extra_stop_ids=[2048])


def test_special_tokens_are_never_allowed(compiler: GrammarCompiler,
                                          tokenizer: tokenizers.Tokenizer) -> None:
    """Inside a JSON string any text goes, but not ``<|im_start|>``, ``<|image_pad|>``, ..."""
    matcher = compiler.matcher(GrammarSpec.json_schema({"type": "string"}))
    assert matcher.accept(token(tokenizer, '"'))
    inside = mask_of(matcher, compiler.vocab_size)
    assert len(inside) > 1500
    assert not inside & set(range(2041, 2048))


def test_verify_masks_match_stepwise_masks_and_keep_the_state(
        compiler: GrammarCompiler, trajectory: tuple[GrammarSpec, list[int]]) -> None:
    spec, ids = trajectory
    matcher = compiler.matcher(spec, generated=ids[:4])
    reference = compiler.matcher(spec, generated=ids[:4])
    bitmask = compiler.allocate_bitmask(8)
    good = ids[4:9]
    assert matcher.fill_verify_bitmask(good, bitmask, row=1) == 5
    for i in range(6):
        assert allowed(bitmask, 1 + i, compiler.vocab_size) == mask_of(reference,
                                                                        compiler.vocab_size)
        if i < 5:
            reference.accept(good[i])
    assert matcher.num_tokens == 4
    after_two = allowed(bitmask, 3, compiler.vocab_size)
    refused = next(t for t in range(compiler.vocab_size) if t not in after_two)
    assert matcher.fill_verify_bitmask([*good[:2], refused, *good[3:]], bitmask, row=1) == 2
    assert allowed(bitmask, 3, compiler.vocab_size) == after_two
    for row in (4, 5, 6):  # past the refused draft token: never used, left all-allowed
        assert len(allowed(bitmask, row, compiler.vocab_size)) == compiler.vocab_size
    assert matcher.num_tokens == 4
    with pytest.raises(ValueError, match="do not fit"):
        matcher.fill_verify_bitmask(good, bitmask, row=3)


def test_greedy_verification_under_the_masks_accepts_only_grammatical_tokens(
        compiler: GrammarCompiler, bias: torch.Tensor) -> None:
    """EAGLE-style: drafts of 3 (the target's own masked greedy chain, that chain with a random
    last token, or random tokens) are verified greedily against masked target logits; every kept
    token and the bonus token satisfy the grammar."""
    spec = GrammarSpec.json_schema(SCHEMAS["flat object"])
    matcher = compiler.matcher(spec)
    gen = torch.Generator().manual_seed(3)
    bitmask = compiler.allocate_bitmask(4)
    kept_counts: list[int] = []
    while not matcher.is_terminated():
        assert len(kept_counts) < MAX_TOKENS
        target = torch.randn(4, compiler.vocab_size, generator=gen) * 2.0 + bias  # [k + 1, V]
        noise = torch.randint(0, compiler.vocab_size, (3,), generator=gen).tolist()
        chain = _greedy_chain(matcher, target, bitmask, 3)
        draft = [chain, [*chain[:2], noise[2]], noise][len(kept_counts) % 3]
        matcher.fill_verify_bitmask(draft, bitmask)
        apply_mask(target, bitmask)
        picks = target.argmax(-1).tolist()
        kept = next((i for i, d in enumerate(draft) if d != picks[i]), len(draft))
        kept_counts.append(kept)
        for token_id in [*draft[:kept], picks[kept]]:
            assert matcher.accept(token_id)
            if matcher.is_terminated():
                break
    assert {0, 2, 3} <= set(kept_counts)


def _greedy_chain(matcher: GrammarMatcher, target: torch.Tensor, bitmask: torch.Tensor,
                  k: int) -> list[int]:
    """The masked argmax chain of ``target``'s first ``k`` rows (state left as it was)."""
    chain: list[int] = []
    for i in range(k):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, 0)
        row = target[i:i + 1].clone()
        apply_mask(row, bitmask[:1])
        chain.append(int(row.argmax()))
        assert matcher.accept(chain[-1])
    matcher.rollback(len(chain))
    return chain


# ---- masks on logits -------------------------------------------------------------------------


def test_masking_keeps_allowed_logits_and_the_greedy_pick(
        compiler: GrammarCompiler, tokenizer: tokenizers.Tokenizer,
        trajectory: tuple[GrammarSpec, list[int]]) -> None:
    """Allowed logits are untouched, the others -inf: the unconstrained argmax survives whenever
    it is allowed. Rows left out of ``rows`` are not masked at all."""
    spec, ids = trajectory
    matchers = [compiler.matcher(spec, generated=ids[:n]) for n in range(0, len(ids) - 1, 3)]
    bitmask = compiler.allocate_bitmask(len(matchers))
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask, row)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(len(matchers), compiler.vocab_size, generator=gen)
    raw[:, token(tokenizer, '"')] = 100.0  # the unconstrained argmax: allowed in some rows
    masked = raw.clone()
    rows = list(range(0, len(matchers) - 1))
    apply_mask(masked, bitmask, rows=rows)
    assert torch.equal(masked[-1], raw[-1])
    agreed = 0
    for row in rows:
        ok = torch.tensor(sorted(allowed(bitmask, row, compiler.vocab_size)))
        assert torch.equal(masked[row, ok], raw[row, ok])
        assert torch.isinf(masked[row]).sum() == compiler.vocab_size - len(ok)
        if int(raw[row].argmax()) in ok.tolist():
            assert int(masked[row].argmax()) == int(raw[row].argmax())
            agreed += 1
        else:
            assert int(masked[row].argmax()) in ok.tolist()
    assert 0 < agreed < len(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_padded_vocabulary_masks_the_padding(tokenizer: tokenizers.Tokenizer,
                                             dtype: torch.dtype) -> None:
    """A model vocabulary wider than the tokenizer's: the extra ids are never allowed."""
    padded = GrammarCompiler(tokenizer, PADDED_VOCAB, [EOS], cache_size=4)
    matcher = padded.matcher(GrammarSpec.json_schema({"type": "string"}))
    assert matcher.accept(token(tokenizer, '"'))
    bitmask = padded.allocate_bitmask(2)
    assert bitmask.shape == (2, (PADDED_VOCAB + 31) // 32)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, PADDED_VOCAB, dtype=dtype)
    apply_mask(logits, bitmask)
    assert torch.isfinite(logits[0]).all()  # row 0 left all-allowed
    assert torch.isinf(logits[1, 2041:]).all() and torch.isfinite(logits[1, 1:2041]).sum() > 1500
    with pytest.raises(ValueError, match="cannot cover"):
        apply_mask(torch.zeros(1, PADDED_VOCAB + 40), bitmask[:1])


# ---- the compiler --------------------------------------------------------------------------


def test_compile_cache_is_keyed_by_the_spec(tokenizer: tokenizers.Tokenizer) -> None:
    small = GrammarCompiler(tokenizer, 2048, [EOS], cache_size=2)
    a = GrammarSpec.json_schema('{"type": "object",\n "properties": {"x": {"type": "integer"}}}')
    same = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    assert a == same and hash(a) == hash(same)
    first = small.compiled(a)
    assert small.compiled(same) is first
    small.compiled(GrammarSpec.regex("[0-9]+"))
    small.compiled(GrammarSpec.choice(["x", "y"]))  # evicts the least recently used: ``a``
    assert small.compiled(a) is not first


def test_whitespace_runs_are_bounded(compiler: GrammarCompiler,
                                     tokenizer: tokenizers.Tokenizer) -> None:
    matcher = compiler.matcher(GrammarSpec.json_object())
    assert matcher.accept(token(tokenizer, "{"))
    space = token(tokenizer, "Ġ")
    for _ in range(MAX_JSON_WHITESPACE):
        assert matcher.accept(space)
    assert not matcher.accept(space)
    assert matcher.accept(token(tokenizer, "}"))


@pytest.mark.parametrize(("text", "ok"), [
    ('"a\\"b"', True), ('"\\n\\t\\\\"', True), ('"\\u00e9xyz"', True), ('"café"', True),
    ('"a"', False), ('"abcde"', False), ('"a\tb"', False), ('"a\x06b"', False),
])
def test_length_bounded_strings_take_escapes_and_refuse_control_characters(
        text: str, ok: bool, compiler: GrammarCompiler, tokenizer: tokenizers.Tokenizer) -> None:
    """2 to 4 characters, an escape counting as one; raw control characters are not JSON
    (xgrammar's own lowering gets both wrong: mlc-ai/xgrammar#800)."""
    spec = GrammarSpec.json_schema({"type": "string", "minLength": 2, "maxLength": 4})
    matcher = compiler.matcher(spec)
    for token_id in tokenizer.encode(text).ids:
        if not matcher.accept(token_id):
            break
    else:  # the whole text went in: complete only when it should be
        complete = mask_of(matcher, compiler.vocab_size) == set(compiler.stop_token_ids)
        assert complete == ok
        return
    assert not ok


def test_from_model_dir_without_tokenizer_is_none(tmp_path: Path) -> None:
    assert GrammarCompiler.from_model_dir(tmp_path) is None


def test_json_schema_specs_are_canonical_and_hashable() -> None:
    spec = GrammarSpec.json_schema('{ "b": 1,  "a": "é" }')
    assert spec.value == '{"b":1,"a":"é"}'  # compact, key order kept
    assert len({spec, GrammarSpec.json_schema({"b": 1, "a": "é"}), GrammarSpec.json_object()}) == 2


@pytest.mark.parametrize("spec", [
    GrammarSpec.json_object(), GrammarSpec.json_schema({"type": "integer"}),
    GrammarSpec.regex("[0-9]+"), GrammarSpec.choice(["a", 'b"', "c\n"]), GrammarSpec.ebnf(
        'root ::= "x"')])
def test_specs_travel_as_two_strings(spec: GrammarSpec) -> None:
    assert GrammarSpec.parse(spec.kind, spec.text) == spec
