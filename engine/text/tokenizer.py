"""Text <-> token ids, on top of the ``tokenizers`` library (never ``transformers``).

:class:`Tokenizer` loads a model directory's ``tokenizer.json``. A checkpoint without one still
serves requests given as token ids, so :meth:`Tokenizer.from_dir` returns ``None`` then.

:class:`IncrementalDetokenizer` turns a stream of generated ids into a stream of text deltas whose
concatenation equals the full decode of all ids, and never emits half a UTF-8 character.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import tokenizers

from engine.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """A loaded ``tokenizer.json``: encode, decode and special-token lookup."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self._inner = inner

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json`` file; raise ConfigError if it cannot be parsed."""
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ConfigError(f"cannot load tokenizer from {path}: {exc}") from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """Load ``model_dir/tokenizer.json``, or return None when the directory has none."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            return None
        return cls.from_file(path)

    @property
    def inner(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._inner

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added (special) tokens included."""
        return self._inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become single ids.

        ``add_special_tokens`` applies the tokenizer's post-processor (BOS/EOS templates); it is
        off by default because chat templates write their special tokens into the text.
        """
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of the token spelled ``token`` (e.g. ``"<|image_pad|>"``), or None if unknown."""
        return self._inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Spelling of ``token_id`` in the vocabulary, or None if out of range."""
        return self._inner.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams the text of a growing id sequence, one delta per :meth:`add` call.

    Invariant: ``"".join(deltas) + finish()`` equals ``tokenizer.decode(all_ids)``.

    Only text that can no longer change is emitted: a trailing U+FFFD may be an incomplete UTF-8
    character whose remaining bytes arrive with the next ids, so it is held back (a genuinely
    invalid byte is emitted as U+FFFD as soon as a later character settles it, or by
    :meth:`finish`). Decoding works on a window that starts at a point where all earlier text was
    complete, so each call costs O(window), not O(sequence). This assumes the decoder is
    prefix-stable (appending ids never changes earlier text), which holds for byte-level BPE.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # window start: text of ids[:_start] is complete
        self._settled = 0  # end of the last complete prefix, ids[:_settled]
        self._emitted = 0  # characters of decode(ids[_start:]) already emitted

    @property
    def ids(self) -> list[int]:
        """All ids added so far (a copy)."""
        return list(self._ids)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append ``new_ids`` and return the text that became final because of them."""
        self._ids.extend(new_ids)
        text = self._decode_window()
        stable = len(text.rstrip(_REPLACEMENT))
        delta = text[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(text):
            self._slide_window()
        return delta

    def finish(self) -> str:
        """Return everything not emitted yet (incomplete characters as U+FFFD)."""
        text = self._decode_window()
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _decode_window(self) -> str:
        return self._tok.decode(self._ids[self._start :], skip_special_tokens=self._skip)

    def _slide_window(self) -> None:
        """All text is complete: move the window to start at the previous complete point.

        Keeping the ids since the previous complete point (rather than none) lets decoders that
        treat a sequence's first token specially (e.g. a leading space) see real context.
        """
        new_start = self._settled
        self._settled = len(self._ids)
        if new_start == self._start:
            return
        self._emitted = len(self._decode_window_from(new_start))
        self._start = new_start

    def _decode_window_from(self, start: int) -> str:
        return self._tok.decode(self._ids[start:], skip_special_tokens=self._skip)
