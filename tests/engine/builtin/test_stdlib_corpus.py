"""The built-in model's corpus split and the held-out prompts cut from it (``--dataset code``)."""

from __future__ import annotations

from bench.loadgen import code_workloads
from engine.builtin import builtin_model_dir
from engine.builtin.stdlib_corpus import read_text, split_files, stdlib_files
from engine.text.tokenizer import Tokenizer


def test_split_holds_out_every_eighth_file() -> None:
    files = stdlib_files()
    train, held = split_files(files)
    assert held and not set(train) & set(held) and len(train) + len(held) == len(files)
    assert held == files[3::8]


def test_code_workloads_are_held_out_text_deterministic_and_distinct() -> None:
    tok = Tokenizer.from_dir(builtin_model_dir())
    assert tok is not None
    works = code_workloads(50, 64, 20, tok.encode, seed=1)
    assert works == code_workloads(50, 64, 20, tok.encode, seed=1)
    assert len(works) == 50 and all(10 <= w.new_tokens <= 30 for w in works)
    assert all(w.token_ids and len(w.token_ids) <= 64 for w in works)
    assert len({tuple(w.token_ids or ()) for w in works}) == 50  # later passes cut new places
    held_text = "".join(read_text(f) for f in split_files(stdlib_files())[1])
    for w in works[:5]:
        assert tok.decode(w.token_ids or []) in held_text
