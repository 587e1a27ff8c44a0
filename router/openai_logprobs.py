"""Log-probabilities in OpenAI's shapes, for the HTTP door.

``/v1/completions`` (``logprobs: N``, with ``echo`` the prompt's too): ``{"tokens",
"token_logprobs", "top_logprobs", "text_offset"}``, lists with one entry per token; each
``top_logprobs`` entry maps token text to log-probability for the token itself and its ``N``
alternatives (as vLLM does; an echoed prompt's first token has ``null`` for both, nothing
predicts it). ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs: N``): ``{"content":
[{"token", "logprob", "bytes", "top_logprobs": [N of {"token", "logprob", "bytes"}]}]}``.
Log-probabilities are the model's own (before temperature, penalties or filters), as the
workers report them. A token's text is its own decoding (special tokens included), so a token
that ends inside a multi-byte character shows U+FFFD, as in OpenAI's and vLLM's answers; its
``bytes`` (chat) are the token's own bytes (a byte-level BPE's, mapped back from its vocabulary
string), so a client can join them into the exact text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.text.tokenizer import Tokenizer
from proto.pdserve.v1 import generate_pb2 as gpb


class TokenTexts:
    """Token id -> its text, cached (``<id>`` without a tokenizer), and its bytes."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's own bytes: its vocabulary string mapped back through byte-level BPE's
        byte alphabet when every character is in it, else the UTF-8 of its text."""
        piece = self.tokenizer.id_to_token(token_id) if self.tokenizer else None
        if piece is not None and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
        return list(self(token_id).encode())

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            tok = self.tokenizer
            text = tok.decode([token_id], skip_special_tokens=False) if tok else f"<{token_id}>"
            self._cache[token_id] = text
        return text


class CompletionLogprobs:
    """One choice's ``logprobs`` object of ``/v1/completions``, built message by message;
    ``text_offset`` counts characters from the start of the choice's text."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def prompt(self, msg: gpb.GenerateResponse) -> dict[str, Any]:
        """The echoed prompt's entries (from the message that carries them)."""
        ids = list(msg.prompt_token_ids)
        tops: list[dict[str, float] | None] = [None]
        tops += [self._top(t, lp, alt) for t, lp, alt in
                 zip(ids[1:], msg.prompt_logprobs, _alternatives(msg.prompt_top_logprobs,
                                                                 len(ids) - 1), strict=True)]
        return self._entries(ids, [None, *msg.prompt_logprobs], tops)

    def tokens(self, msg: gpb.GenerateResponse) -> dict[str, Any]:
        """The entries of a message's new tokens."""
        ids = list(msg.token_ids)
        alts = _alternatives(msg.top_logprobs, len(ids))
        tops: list[dict[str, float] | None] = [
            self._top(t, lp, alt) for t, lp, alt in zip(ids, msg.logprobs, alts, strict=True)]
        return self._entries(ids, list(msg.logprobs), tops)

    def _top(self, token: int, logprob: float, alt: gpb.TopLogprobs | None) -> dict[str, float]:
        top = {self.texts(token): logprob}
        if alt is not None:
            for t, lp in zip(alt.token_ids, alt.logprobs, strict=True):
                top.setdefault(self.texts(t), lp)
        return top

    def _entries(self, ids: list[int], logprobs: Sequence[float | None],
                 tops: list[dict[str, float] | None]) -> dict[str, Any]:
        tokens = [self.texts(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops,
                "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, msg: gpb.GenerateResponse, top: int) -> dict[str, Any]:
    """The ``logprobs`` object of ``/v1/chat/completions`` for a message's new tokens."""
    content = []
    alts = _alternatives(msg.top_logprobs, len(msg.token_ids))
    for t, lp, alt in zip(msg.token_ids, msg.logprobs, alts, strict=True):
        entry = _chat_entry(texts, t, lp)
        pairs = zip(alt.token_ids, alt.logprobs, strict=True) if alt is not None else ()
        entry["top_logprobs"] = [_chat_entry(texts, a, alp) for a, alp in pairs][:top]
        content.append(entry)
    return {"content": content}


def merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The parts of one choice (completions or chat objects) as one object; None if none."""
    if not parts:
        return None
    out: dict[str, Any] = {k: [] for k in parts[0]}
    for part in parts:
        for key, values in part.items():
            out[key] += values
    return out


def _chat_entry(texts: TokenTexts, token: int, logprob: float) -> dict[str, Any]:
    return {"token": texts(token), "logprob": logprob, "bytes": texts.bytes_of(token)}


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): character -> the byte it stands for. Printable
    bytes stand for themselves; the others map to the code points from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_BYTE_OF = _byte_alphabet()


def _alternatives(tops: Sequence[gpb.TopLogprobs], n: int) -> list[gpb.TopLogprobs | None]:
    """``tops`` padded with None to ``n`` (a worker sends none when none were asked for)."""
    return [*tops, *[None] * (n - len(tops))][:n]
