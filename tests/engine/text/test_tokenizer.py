"""engine.text.tokenizer and engine.builtin.tiny_tokenizer: round trips, special tokens, streaming
decode."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.builtin.tiny_tokenizer import (
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    special_token_ids,
)
from engine.errors import ConfigError
from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer

VOCAB = 512
MULTILINGUAL = "héllo wörld, ça va? Ελληνικά кириллица 日本語のテキスト 한국어 😀👍🏽 ∀x∈ℝ ←→"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer(VOCAB))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model")
    build_tiny_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    return str(path)


# ---- tiny tokenizer ----------------------------------------------------------------------------


def test_tiny_tokenizer_layout() -> None:
    raw = build_tiny_tokenizer(VOCAB)
    assert raw.get_vocab_size(with_added_tokens=True) == VOCAB
    ids = special_token_ids(VOCAB)
    assert list(ids) == SPECIAL_TOKENS
    assert list(ids.values()) == list(range(VOCAB - len(SPECIAL_TOKENS), VOCAB))
    for token, token_id in ids.items():
        assert raw.token_to_id(token) == token_id
    assert SPECIAL_TOKENS[0] == "<|endoftext|>" and SPECIAL_TOKENS[-1] == "<|video_pad|>"


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, 1000, 2048])
def test_tiny_tokenizer_sizes(vocab_size: int) -> None:
    raw = build_tiny_tokenizer(vocab_size)
    assert raw.get_vocab_size(with_added_tokens=True) == vocab_size
    assert raw.token_to_id("<|video_pad|>") == vocab_size - 1


def test_tiny_tokenizer_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        build_tiny_tokenizer(MIN_VOCAB_SIZE - 1)
    with pytest.raises(ValueError):
        build_tiny_tokenizer(10**6)


def test_tiny_tokenizer_is_fast_and_deterministic() -> None:
    start = time.perf_counter()
    first = build_tiny_tokenizer(VOCAB).to_str()
    assert time.perf_counter() - start < 2.0
    assert build_tiny_tokenizer(VOCAB).to_str() == first
    # A fresh interpreter with another hash seed builds the same file.
    code = (
        "import sys; from engine.builtin.tiny_tokenizer import build_tiny_tokenizer as b; "
        "sys.stdout.write(b(512).to_str())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        cwd=Path(__file__).resolve().parents[3],
    ).stdout
    assert other == first


def test_loadable_by_transformers(tok_dir: str, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tok_dir}/tokenizer.json")
    text = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{MULTILINGUAL}<|im_end|>"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert len(hf) == VOCAB
    ids = tok.encode(text)
    assert hf.decode(ids) == tok.decode(ids, skip_special_tokens=False)


# ---- Tokenizer ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_round_trip_multilingual(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode(MULTILINGUAL)) == MULTILINGUAL


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    ids = special_token_ids(VOCAB)
    for token in SPECIAL_TOKENS:
        assert tok.encode(token) == [ids[token]]
        assert tok.token_to_id(token) == ids[token]
    text = "a<|vision_start|><|image_pad|><|vision_end|>b<|im_end|>"
    encoded = tok.encode(text)
    assert encoded[1:4] == [ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"]]
    assert tok.decode(encoded) == "ab"
    assert tok.decode(encoded, skip_special_tokens=False) == text


def test_vocab_and_lookup(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB
    assert tok.token_to_id("<|no_such_token|>") is None
    assert tok.id_to_token(VOCAB - 1) == "<|video_pad|>"


def test_from_dir(tmp_path, tok_dir: str, tok: Tokenizer) -> None:
    assert Tokenizer.from_dir(tmp_path) is None
    loaded = Tokenizer.from_dir(tok_dir)
    assert loaded is not None
    assert loaded.encode(MULTILINGUAL) == tok.encode(MULTILINGUAL)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ConfigError):
        Tokenizer.from_dir(tmp_path)


# ---- IncrementalDetokenizer ---------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], cuts: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    deltas = [detok.add(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return deltas, detok.finish()


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=30),
    skip=st.booleans(),
)
def test_stream_equals_full_decode_random_ids(
    tok: Tokenizer, ids: list[int], cuts: list[int], skip: bool
) -> None:
    deltas, rest = _stream(tok, ids, cuts, skip)
    assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_stream_of_valid_text_never_splits_characters(
    tok: Tokenizer, text: str, cuts: list[int]
) -> None:
    ids = tok.encode(text)
    deltas, rest = _stream(tok, ids, cuts, skip=False)
    assert "".join(deltas) + rest == text
    if "\ufffd" not in text:
        assert rest == ""
        assert all("\ufffd" not in d for d in deltas)


def test_stream_one_token_at_a_time(tok: Tokenizer) -> None:
    ids = tok.encode(MULTILINGUAL)
    assert len(ids) > len(MULTILINGUAL) // 2  # the tiny vocab splits multi-byte characters
    detok = tok.detokenizer()
    seen = ""
    for token_id in ids:
        seen += detok.add([token_id])
        assert MULTILINGUAL.startswith(seen)
    assert seen + detok.finish() == MULTILINGUAL
    assert detok.ids == ids


def test_stream_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n日本<|im_end|>")
    detok = tok.detokenizer()
    assert "".join(detok.add([i]) for i in ids) + detok.finish() == "assistant\n日本"
