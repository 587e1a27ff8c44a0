"""A tiny, deterministic byte-level BPE tokenizer for tests and toy checkpoints.

The tokenizer is trained with the ``tokenizers`` library on a corpus that this module builds
itself from data every Python has and that never changes between Python versions: the names of
Unicode characters (which the Unicode standard promises never to change once assigned), the
characters themselves and Python's keywords, arranged into English-like and code-like lines.
Building it twice, in any process, gives byte-identical ``tokenizer.json`` text.

Layout of the ids (``vocab_size`` = V):

* ``0 .. V - 8``: the 256 byte-level symbols followed by learned merges;
* ``V - 7 .. V - 1``: :data:`SPECIAL_TOKENS`, in that order.

Like Qwen2's tokenizer it has no normalizer, so any text round-trips through encode and decode.
"""

from __future__ import annotations

import keyword
import unicodedata

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

_NUM_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = _NUM_BYTE_SYMBOLS + len(SPECIAL_TOKENS)

# Blocks of characters assigned in Unicode 6.0 or earlier (their names are frozen forever).
_CHAR_RANGES: tuple[tuple[int, int], ...] = (
    (0x00C0, 0x00FF),  # Latin-1 letters
    (0x0100, 0x017F),  # Latin Extended-A
    (0x0391, 0x03C9),  # Greek
    (0x0410, 0x044F),  # Cyrillic
    (0x05D0, 0x05EA),  # Hebrew
    (0x0627, 0x064A),  # Arabic letters
    (0x0905, 0x0939),  # Devanagari letters
    (0x3041, 0x3096),  # Hiragana
    (0x30A1, 0x30FA),  # Katakana
    (0x4E00, 0x4EFF),  # CJK ideographs (first 256)
    (0xAC00, 0xAC7F),  # Hangul syllables (first 128)
    (0x2190, 0x21FF),  # arrows
    (0x2200, 0x22FF),  # mathematical operators
    (0x2500, 0x257F),  # box drawing
    (0x1F600, 0x1F64F),  # emoticons (four-byte UTF-8)
)


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of :data:`SPECIAL_TOKENS` in a tiny tokenizer of ``vocab_size`` tokens (the last ids)."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def _characters() -> list[tuple[str, str]]:
    """``(character, lower-case name)`` for every named code point of :data:`_CHAR_RANGES`."""
    out: list[tuple[str, str]] = []
    for lo, hi in _CHAR_RANGES:
        for cp in range(lo, hi + 1):
            name = unicodedata.name(chr(cp), "")
            if name:
                out.append((chr(cp), name.lower()))
    return out


def _prose_lines(chars: list[tuple[str, str]]) -> list[str]:
    """English-like sentences about each character."""
    return [
        f"The character {ch!r} is called {name} (code point U+{ord(ch):04X}, "
        f"{len(ch.encode('utf-8'))} bytes in UTF-8)."
        for ch, name in chars
    ]


def _script_lines(chars: list[tuple[str, str]]) -> list[str]:
    """Runs of consecutive characters, so that multi-byte characters get merged too."""
    text = "".join(ch for ch, _ in chars)
    return [" ".join(text[i : i + 4] for i in range(j, j + 48, 4)) for j in range(0, len(text), 48)]


def _code_lines(chars: list[tuple[str, str]]) -> list[str]:
    """Python-looking functions built from keywords and words of character names."""
    words = sorted({w for _, name in chars for w in name.split() if w.isalpha()})
    kws = keyword.kwlist
    lines = []
    for i, word in enumerate(words):
        kw = kws[i % len(kws)]
        lines.append(
            f"def {word}_{i}(value: int) -> int:\n"
            f"    # {kw} {word}\n"
            f"    if value > {i}:\n"
            f"        return value * {i % 7 + 2}  # {word.upper()}\n"
            f'    return {word!r}.count("{word[:2]}")\n'
        )
    return lines


def _corpus() -> list[str]:
    """The fixed training corpus (identical on every machine and Python version)."""
    chars = _characters()
    return _prose_lines(chars) + _script_lines(chars) + _code_lines(chars)


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train the tiny byte-level BPE tokenizer with exactly ``vocab_size`` tokens.

    The last ``len(SPECIAL_TOKENS)`` ids are the special tokens (see :func:`special_token_ids`).
    Raises ValueError when ``vocab_size`` is below :data:`MIN_VOCAB_SIZE` or more than the
    corpus can fill with merges.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    learned = tok.get_vocab_size(with_added_tokens=False)
    if learned != vocab_size - len(SPECIAL_TOKENS):
        raise ValueError(
            f"the tiny corpus only supports {learned + len(SPECIAL_TOKENS)} tokens, "
            f"asked for {vocab_size}"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok
