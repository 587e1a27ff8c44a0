"""Structured outputs: grammars (JSON schema, JSON object, regex, choice, EBNF) as token masks.

Built on xgrammar. The pieces, and who holds them:

* :class:`GrammarSpec` is what a request asks for: a ``kind`` (the names of OpenAI's
  ``response_format`` and vLLM's ``structured_outputs``: ``json_object``, ``json_schema``,
  ``regex``, ``choice``, ``grammar``) and its value, as plain strings, so it can travel in a
  request's sampling values and between nodes. A spec that cannot be served raises
  :class:`InvalidRequestError` naming what is wrong (bad JSON, a JSON-schema keyword the grammar
  cannot enforce and where it sits, an invalid regex): the servers answer 400 /
  ``INVALID_ARGUMENT``.
* :class:`GrammarCompiler` is built once per served model from its tokenizer, its vocabulary size
  (``config.json``'s, which may exceed the tokenizer's: the extra ids are never allowed) and its
  EOS ids; it compiles specs (an LRU cache keyed by the spec) and makes matchers.
* :class:`GrammarMatcher` is one request's state: the mask of the next token
  (:meth:`~GrammarMatcher.fill_bitmask`), :meth:`~GrammarMatcher.accept`,
  :meth:`~GrammarMatcher.rollback` (drafted tokens that verification rejected), the masks of a
  speculative verification (:meth:`~GrammarMatcher.fill_verify_bitmask`) and
  :meth:`~GrammarMatcher.replay`, which rebuilds the state on another node from the tokens
  generated so far (the prefill node samples the first token, the decode node goes on).
* :func:`apply_mask` sets the disallowed logits of a batch to ``-inf``, in place.

Invariants: a bitmask is ``int32 [rows, ceil(vocab_size / 32)]`` on the host, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed; once the grammar is complete only the stop ids
(the model's EOS ids and the request's own) are allowed, and a terminated matcher (it accepted a
stop id) allows nothing else. Special tokens (``<|im_start|>``, ``<|image_pad|>``, ...) and ids
past the tokenizer's vocabulary are never allowed: their text is not what the grammar matched.
JSON output may hold whitespace between its elements, at most :data:`MAX_JSON_WHITESPACE`
characters in a row (an unbounded run lets a model loop on blanks forever).

What the grammar cannot enforce is refused rather than ignored: ``not``, ``if``/``then``/``else``,
``contains`` (and ``minContains``/``maxContains``), ``uniqueItems: true``,
``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``allOf`` with more than one
member, a ``$ref`` outside the schema and patterns with lookaround, backreferences, word
boundaries or inline flags, and ``minLength``/``maxLength`` beside a ``pattern`` or ``format``.
Some limits remain: ``oneOf`` is matched as ``anyOf`` (an output satisfies at least one member,
not exactly one), objects open to extra keys (``additionalProperties`` / ``patternProperties``)
may repeat a key, and a string under a ``pattern`` holds no escapes (no quote, backslash or
newline). Properties come in the schema's order and, as in OpenAI's strict mode, an object takes
no keys its schema does not name unless it says ``additionalProperties``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from engine.config import ModelConfig
from engine.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_JSON_WHITESPACE = 32  # whitespace characters in a row between the elements of JSON output
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per compiler
TOKENIZER_FILE = "tokenizer.json"

# JSON-schema keywords the grammar cannot enforce (xgrammar accepts and ignores them).
_UNENFORCEABLE = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
                  "dependentRequired", "dependentSchemas", "dependencies")
# Where a schema holds subschemas: a map of them, one, or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties",
               "unevaluatedItems", "propertyNames", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[12:00:00] /path/file.cc:42: "
# xgrammar lowers a string with minLength/maxLength to a repetition of this rule, whose class
# lacks JSON's escapes and admits raw control characters (mlc-ai/xgrammar#800, open in 0.2.9):
# such rules become one JSON string character each (an escape counts as one character).
_BOUNDED_CHARACTER = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_CHARACTER = (r'(([^\0-\x1f\"\\]) | ("\\" ([\"\\/bfnrt] | '
                   r'("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))')


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: ``kind`` (one of :data:`GRAMMAR_KINDS`) and ``value``.

    ``value`` is the schema's JSON text (``json_schema``; kept in a compact canonical form, key
    order preserved, so equal schemas are equal specs), the pattern (``regex``), the options
    (``choice``, a tuple of strings) or the EBNF text with a ``root`` rule (``grammar``); empty for
    ``json_object``. Construction checks the shape of the value; :meth:`validate` also checks
    what needs the grammar library (regex syntax, schema keywords). Both raise
    :class:`InvalidRequestError`.
    """

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}: expected "
                                      f"one of {', '.join(GRAMMAR_KINDS)}")
        if self.kind == "choice":
            object.__setattr__(self, "value", _choices(self.value))
        elif not isinstance(self.value, str):
            raise InvalidRequestError(f"{self.kind} must be given as a string")
        elif self.kind == "json_schema":
            object.__setattr__(self, "value", _canonical_schema(self.value))
        elif self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError(f"{self.kind} is empty")
        elif self.kind == "json_object" and self.value:
            raise InvalidRequestError("json_object takes no value")

    @classmethod
    def parse(cls, kind: str, text: str) -> GrammarSpec:
        """The spec whose :attr:`text` is ``text`` (how a spec travels as two strings)."""
        if kind != "choice":
            return cls(kind, text)
        try:
            options = json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"choice is not a JSON list: {exc}") from exc
        return cls(kind, tuple(options) if isinstance(options, list) else text)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any] | bool) -> GrammarSpec:
        """JSON valid under ``schema`` (its JSON text, or the decoded object)."""
        text = schema if isinstance(schema, str) else json.dumps(
            schema if isinstance(schema, bool) else dict(schema))
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """Text that ``pattern`` matches in full."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Iterable[str]) -> GrammarSpec:
        """Exactly one of ``options``."""
        return cls("choice", tuple(options))

    @classmethod
    def ebnf(cls, text: str) -> GrammarSpec:
        """Text of the EBNF grammar ``text`` (xgrammar's dialect, starting at rule ``root``)."""
        return cls("grammar", text)

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the problem if the spec cannot be served
        (it needs no tokenizer: a node can check a request before it has a compiler)."""
        self.to_grammar()

    def to_grammar(self) -> xgr.Grammar:
        """The spec as an xgrammar grammar; :class:`InvalidRequestError` if it cannot be."""
        try:
            if self.kind == "json_schema":
                _check_schema(json.loads(self.text))
            return _build(self.kind, self.value)
        except RecursionError as exc:
            raise InvalidRequestError(f"{self.kind} is nested too deeply") from exc
        except RuntimeError as exc:  # xgrammar reports bad input as RuntimeError
            raise InvalidRequestError(f"invalid {self.kind}: {_reason(exc)}") from exc

    @property
    def text(self) -> str:
        """The value as one string (``choice``: its options as a JSON list); see :meth:`parse`."""
        return self.value if isinstance(self.value, str) else json.dumps(list(self.value))


def _choices(value: str | tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, str) or not value:
        raise InvalidRequestError("choice must be a non-empty list of strings")
    options = tuple(value)
    bad = [o for o in options if not isinstance(o, str) or not o]
    if bad:
        raise InvalidRequestError(f"choice options must be non-empty strings, got {bad[0]!r}")
    return options


def _canonical_schema(text: str) -> str:
    try:
        schema = json.loads(text)
    except RecursionError as exc:
        raise InvalidRequestError("json_schema is nested too deeply") from exc
    except ValueError as exc:
        raise InvalidRequestError(f"json_schema is not valid JSON: {exc}") from exc
    if schema is not True and not isinstance(schema, dict):
        raise InvalidRequestError("json_schema must be a JSON object (or true), got "
                                  f"{type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _build(kind: str, value: str | tuple[str, ...]) -> xgr.Grammar:
    """The xgrammar grammar of one validated spec (xgrammar may raise RuntimeError)."""
    if kind == "choice":
        alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in value)
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    assert isinstance(value, str)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    schema = '{"type":"object"}' if kind == "json_object" else value
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True,
                                           max_whitespace_cnt=MAX_JSON_WHITESPACE)
    ebnf = str(grammar)
    fixed = _BOUNDED_CHARACTER.sub(lambda m: f"{m.group(1)} ::= {_JSON_CHARACTER}", ebnf)
    return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix (time, source file and line)."""
    lines = [_XGRAMMAR_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return next((line for line in reversed(lines) if line), type(exc).__name__)


def _check_schema(schema: Any) -> None:
    """Raise :class:`InvalidRequestError` at the first keyword the grammar cannot enforce."""
    for pointer, sub in _subschemas(schema, "#"):
        problem = _unenforceable(sub)
        if problem:
            raise InvalidRequestError(f"json_schema: {problem} at {pointer} is not supported "
                                      "(structured outputs cannot enforce it)")
        for pattern in _patterns(sub):
            try:
                xgr.Grammar.from_regex(pattern)
            except RuntimeError as exc:
                raise InvalidRequestError(f"json_schema: the pattern {pattern!r} at {pointer} is "
                                          f"not supported: {_reason(exc)}") from exc


def _subschemas(schema: Any, pointer: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in ``schema`` (itself first) with its JSON pointer."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{pointer}/{key}/{_escape(name)}")
    for key in _SCHEMA_ONE:
        yield from _subschemas(schema.get(key), f"{pointer}/{key}")
    for key in _SCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{pointer}/{key}/{i}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _unenforceable(schema: dict[str, Any]) -> str | None:
    """The first keyword of ``schema`` (not of its subschemas) that cannot be enforced."""
    for key in _UNENFORCEABLE:
        if key in schema:
            return f"{key!r}"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems'"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "'allOf' with more than one member"
    if ("minLength" in schema or "maxLength" in schema) and (
            "pattern" in schema or "format" in schema):
        return "'minLength'/'maxLength' together with 'pattern' or 'format'"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"the external '$ref' {ref!r}"
    return None


def _patterns(schema: dict[str, Any]) -> list[str]:
    """The regular expressions ``schema`` itself holds (``pattern``, ``patternProperties``)."""
    found = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
    pattern_properties = schema.get("patternProperties")
    if isinstance(pattern_properties, dict):
        found.extend(pattern_properties)
    return found


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one model and makes their matchers (thread-safe).

    ``vocab_size`` is the model's (the logits' width), ``stop_token_ids`` its EOS ids (allowed
    when the grammar is complete). Special tokens and ids past the tokenizer's vocabulary are
    never allowed. Compiled grammars are kept in an LRU cache of ``cache_size`` specs.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                 stop_token_ids: Sequence[int], *, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if not stop_token_ids:
            raise ValueError("structured outputs need at least one stop token id")
        self._vocab_size = vocab_size
        self._stop_ids = tuple(dict.fromkeys(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size,
                                                             self._stop_ids),
                                             cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, cache_size: int = DEFAULT_CACHE_SIZE
                       ) -> GrammarCompiler | None:
        """The compiler of a model directory (its ``tokenizer.json``, and its ``config.json``'s
        vocabulary size and EOS ids); None when it has no tokenizer (no structured outputs)."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            return None
        config = ModelConfig.from_dir(model_dir)
        return cls(tokenizers.Tokenizer.from_file(str(path)), config.text.vocab_size,
                   config.eos_token_ids, cache_size=cache_size)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: the width of the logits the masks apply to."""
        return self._vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids, allowed once the grammar is complete."""
        return self._stop_ids

    def compiled(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """``spec`` compiled for this vocabulary (cached); :class:`InvalidRequestError` if it
        cannot be served. Costs milliseconds to seconds with the vocabulary and the grammar:
        call it off the step loop."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        compiled = self._compiler.compile_grammar(spec.to_grammar())
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec, generated: Sequence[int] = (),
                extra_stop_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for ``spec``, having accepted ``generated`` (the request's output so
        far, e.g. the prefill node's first token); ``extra_stop_ids`` (the request's own stop
        ids) end the output like the EOS ids."""
        stop_ids = tuple(dict.fromkeys((*self._stop_ids, *extra_stop_ids)))
        outside = [t for t in stop_ids if not 0 <= t < self._vocab_size]
        if outside:
            raise InvalidRequestError(f"stop token id {outside[0]} is outside the vocabulary")
        matcher = GrammarMatcher(self.compiled(spec), self._vocab_size, stop_ids)
        matcher.replay(generated)
        return matcher

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A host bitmask of ``rows`` rows, every token allowed."""
        return xgr.allocate_token_bitmask(rows, self._vocab_size)


def _tokenizer_info(tokenizer: tokenizers.Tokenizer, vocab_size: int,
                    stop_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary; special tokens and padding ids are spelled "", which
    xgrammar never allows (it would otherwise match ``<|im_start|>`` as text)."""
    detected = xgr.TokenizerInfo.from_huggingface(  # vocabulary type and prefix space
        PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer.to_str())),
        vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            vocab[token_id] = token
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_ids),
                             add_prefix_space=detected.add_prefix_space)


class GrammarMatcher:
    """One request's position in its grammar. Made by :meth:`GrammarCompiler.matcher`.

    Every token the request outputs goes through :meth:`accept` in order, the stop token too;
    :attr:`num_tokens` counts them. Not thread-safe: one request, one thread.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int,
                 stop_token_ids: tuple[int, ...]) -> None:
        self._inner = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self._vocab_size = vocab_size
        self._stop_ids = stop_token_ids
        self._stop_row: torch.Tensor | None = None
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (rolled-back ones not counted)."""
        return self._num_tokens

    def is_terminated(self) -> bool:
        """Whether the matcher accepted a stop token: the output is complete."""
        return self._inner.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """Write the next token's mask into ``bitmask[row]`` (the state does not change); only
        the stop ids once terminated. Returns False when the row allows every token (applying
        it may be skipped)."""
        if self.is_terminated():
            bitmask[row] = self._stop_only_row()
            return True
        return self._inner.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) when the grammar does not allow it."""
        if self.is_terminated() or not 0 <= token_id < self._vocab_size:
            return False
        if not self._inner.accept_token(token_id):
            return False
        self._num_tokens += 1
        return True

    def replay(self, token_ids: Sequence[int]) -> None:
        """Accept ``token_ids`` in order (rebuilding a request's state from its output so far).
        A token the grammar refuses raises :class:`InvalidRequestError` and leaves the state as
        it was before the call."""
        for i, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                self.rollback(i)
                raise InvalidRequestError(f"output token {token_id} (position {i}) does not "
                                          "satisfy the request's structured output grammar")

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` accepted tokens (0 <= n <= :attr:`num_tokens`)."""
        if not 0 <= n <= self._num_tokens:
            raise ValueError(f"cannot roll back {n} of {self._num_tokens} tokens")
        if n:
            self._inner.rollback(n)
            self._num_tokens -= n

    def fill_verify_bitmask(self, draft_tokens: Sequence[int], bitmask: torch.Tensor,
                            row: int = 0) -> int:
        """The masks of one speculative verification: ``bitmask[row + i]`` for the token after
        ``draft_tokens[:i]``, for ``i`` in ``0..k`` (``k + 1`` rows). Returns ``m``, how many
        leading draft tokens the grammar allows; rows past ``m`` stay all-allowed: verification
        under these masks rejects ``draft_tokens[m]`` (its logit is ``-inf``) and never reaches
        them. The state is unchanged: :meth:`accept` the tokens verification keeps."""
        if bitmask.shape[0] < row + len(draft_tokens) + 1:
            raise ValueError(f"{len(draft_tokens) + 1} mask rows from row {row} do not fit a "
                             f"bitmask of {bitmask.shape[0]} rows")
        accepted = 0
        for i in range(len(draft_tokens) + 1):
            self.fill_bitmask(bitmask, row + i)
            if i == len(draft_tokens) or not self.accept(draft_tokens[i]):
                break
            accepted += 1
        xgr.reset_token_bitmask(bitmask[row + accepted + 1:row + len(draft_tokens) + 1])
        self.rollback(accepted)
        return accepted

    def _stop_only_row(self) -> torch.Tensor:
        if self._stop_row is None:
            words = np.zeros(xgr.get_bitmask_shape(1, self._vocab_size)[1], dtype=np.uint32)
            for token_id in self._stop_ids:
                words[token_id // 32] |= np.uint32(1 << (token_id % 32))
            self._stop_row = torch.from_numpy(words.view(np.int32))
        return self._stop_row


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor,
               rows: Sequence[int] | None = None) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    ``logits`` is ``[n, V]`` (float32, bfloat16 or float16) on any device, ``bitmask``
    ``[n, ceil(V / 32)]`` as filled by the matchers (on the host; copied to the logits' device
    when they are elsewhere). ``rows`` limits the masking to those rows (requests with a
    grammar); None masks every row.
    """
    if bitmask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words cannot cover "
                         f"{logits.shape[-1]} logits")
    if rows is not None and not rows:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                    indices=None if rows is None else list(rows))
