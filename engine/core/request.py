"""The request model shared by every node kind: sampling values and token counters.

A :class:`Request` is token counters, not phases. ``num_computed_tokens`` counts the tokens whose
KV is in the pool; it catches up with ``num_tokens`` (prompt + output). After prefill a request has
``num_tokens == num_computed_tokens + 1``: the last sampled token has no KV yet, and a decode step
computes that one token and samples the next. Pure Python: no torch here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.errors import InvalidRequestError

MAX_TEMPERATURE = 100.0
MAX_NEW_TOKENS_LIMIT = 1_000_000
MAX_SEED = 2**63 - 1
MAX_PENALTY = 2.0  # |frequency_penalty| and |presence_penalty| at most this (OpenAI's range)
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit, vLLM's default)
MAX_LOGIT_BIAS = 100.0  # |bias| at most this (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one request may bias


class TopLogprobs(NamedTuple):
    """The ``k`` most likely tokens at one position and their log-probabilities under the
    model's own distribution, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    A step's logits go through, in this order:

    1. penalties, on the raw logits: ``repetition_penalty`` ``r`` (> 0, 1 = off) over every
       token seen so far (prompt and output): a positive logit is divided by ``r``, a negative
       one multiplied by it; then ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``
       (each in [-2, 2], 0 = off) over output tokens only:
       ``logit -= f * count + p * (count > 0)``; then ``logit_bias`` (``(token, bias)`` pairs,
       each bias in [-100, 100], OpenAI's): ``logit += bias``;
    2. ``temperature`` (0 = greedy: the argmax of the penalized logits, no filter applies);
    3. ``top_k`` (0 = off), then ``top_p`` (1 = off) on what top-k kept, then ``min_p``
       (0 = off): keep the tokens whose probability is at least ``min_p`` times the most
       likely token's.

    ``stop`` strings end the text right before the first occurrence of any of them (the router
    cuts the text; workers carry them unread). ``top_logprobs`` (0 to :data:`MAX_TOP_LOGPROBS`)
    asks for that many alternatives with each output token's log-probability;
    ``prompt_logprobs`` (None = off, else 0 to :data:`MAX_TOP_LOGPROBS` alternatives) asks for
    the log-probability of every prompt token after the first (the prefix cache is bypassed for
    it: cached positions have no logits). ``structured_output`` (None = free text) is a grammar
    the output must match, as ``(kind, value)`` strings
    (:class:`engine.sampling.grammar.GrammarSpec`'s ``kind`` and ``text``): the engine checks it
    when the request arrives and masks every sampled (and verified) token with it; the
    log-probabilities stay the model's own. ``seed`` makes a request's samples reproducible
    and independent of its batch.

    ``resumed_tokens`` marks a request resubmitted after a failure (the router's failover): the
    last ``resumed_tokens`` prompt tokens are output the client already has, so the frequency and
    presence penalties count them as output. It must be less than the prompt's length.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    resumed_tokens: int = 0
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    structured_output: tuple[str, str] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any penalty (or a logit bias) changes the logits: they are applied together
        (:mod:`engine.sampling.penalties`, where each request with them has a token history)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or bool(self.logit_bias))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad value, if any."""
        _check_temperature(self.temperature)
        _check_top_p(self.top_p)
        _check_int("top_k", self.top_k, 0, None)
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        _check_stop_ids(self.stop_token_ids, vocab_size)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_repetition_penalty(self.repetition_penalty)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_stops(self.stop)
        _check_int("resumed_tokens", self.resumed_tokens, 0, None)
        _check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.structured_output is not None:
            _check_structured_output(self.structured_output, self.ignore_eos)
        _check_logit_bias(self.logit_bias, vocab_size)


def _check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int | None) -> None:
    if not isinstance(bias, tuple) or not all(isinstance(p, tuple) and len(p) == 2
                                              for p in bias):
        raise InvalidRequestError(f"logit_bias must be (token, bias) pairs, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(f"logit_bias biases {len(bias)} tokens, more than the limit "
                                  f"of {MAX_LOGIT_BIAS_TOKENS}")
    for token, value in bias:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0 or (
                vocab_size is not None and token >= vocab_size):
            raise InvalidRequestError(f"logit_bias has a token id outside the vocabulary: "
                                      f"{token!r}")
        _check_range(f"logit_bias of token {token}", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    if len({token for token, _ in bias}) != len(bias):
        raise InvalidRequestError("logit_bias names a token twice")


def _check_structured_output(spec: tuple[str, str], ignore_eos: bool) -> None:
    """The shape of ``structured_output``; its content is the grammar module's to check."""
    if (not isinstance(spec, tuple) or len(spec) != 2
            or not all(isinstance(part, str) for part in spec)):
        raise InvalidRequestError(
            f"structured_output must be a (kind, value) pair of strings, got {spec!r}")
    if ignore_eos:
        raise InvalidRequestError("ignore_eos cannot be combined with a structured output: "
                                  "a complete output must end")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_temperature(t: float) -> None:
    if not _is_real(t) or math.isnan(t) or not 0.0 <= t <= MAX_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {t!r}"
        )


def _check_top_p(p: float) -> None:
    if not _is_real(p) or math.isnan(p) or not 0.0 < p <= 1.0:
        raise InvalidRequestError(f"top_p must be a number in (0, 1], got {p!r}")


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not _is_real(value) or math.isnan(value) or not lo <= value <= hi:
        raise InvalidRequestError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")


def _check_repetition_penalty(r: float) -> None:
    if not _is_real(r) or not math.isfinite(r) or r <= 0.0:
        raise InvalidRequestError(
            f"repetition_penalty must be a finite number above 0 (1 = off), got {r!r}")


def _check_stops(stops: tuple[str, ...]) -> None:
    if not isinstance(stops, tuple) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError(f"stop must be a tuple of non-empty strings, got {stops!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"{len(stops)} stop strings is more than the limit of {MAX_STOP_STRINGS}")


def _check_int(name: str, value: int, lo: int, hi: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        upper = "" if hi is None else f" and at most {hi}"
        raise InvalidRequestError(f"{name} must be at least {lo}{upper}, got {value}")


def _check_stop_ids(ids: tuple[int, ...], vocab_size: int | None) -> None:
    if not isinstance(ids, tuple):
        raise InvalidRequestError(f"stop_token_ids must be a tuple of ints, got {ids!r}")
    for tok in ids:
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise InvalidRequestError(f"stop_token_ids has an invalid token id {tok!r}")
        if vocab_size is not None and tok >= vocab_size:
            raise InvalidRequestError(
                f"stop token id {tok} is outside the vocabulary (size {vocab_size})"
            )


class FinishReason(str, enum.Enum):
    """Why a request stopped producing tokens."""

    STOP = "stop"  # a stop or EOS token was sampled (it is kept in the output), or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # cancelled, or failed by the server


@dataclass(slots=True, eq=False)
class Request:
    """One generation request, as token counters.

    Invariants kept by the scheduler:
      * ``0 <= num_computed_tokens <= num_tokens``;
      * ``page_ids`` hold the KV of tokens ``[0, num_computed_tokens)`` in order (token ``i`` lives
        in ``page_ids[i // page_size]``), and may cover a few tokens beyond while a step runs;
      * ``len(output_logprobs) == len(output_token_ids)`` for tokens the engine sampled, and so
        is ``len(output_top_logprobs)`` when ``sampling.top_logprobs`` is set (else it is empty);
      * with ``sampling.prompt_logprobs`` set, ``prompt_logprobs[i]`` is prompt token ``i + 1``'s
        log-probability (and ``prompt_top_logprobs[i]`` its alternatives) once the forward
        computed position ``i``; both are empty otherwise;
      * once ``finish_reason`` is set the request never runs again;
      * ``batch_row`` is the request's row in the runner's persistent batch while it runs (given
        at admission, taken back when it finishes or is aborted), -1 otherwise;
      * ``state_slot`` likewise is its slot of a hybrid model's state pool while it runs (or,
        adopted from a transfer, from :meth:`Scheduler.add` on, holding the transferred
        states), -1 otherwise (and always -1 for a model without linear attention).

    ``payload`` is opaque engine data (images, mrope delta, ...); the scheduler never reads it.
    ``history`` is the token history of a request with penalties (``engine.sampling.penalties``
    makes it on first use); ``grammar`` likewise the grammar matcher of a request with a
    ``structured_output`` (``engine.sampling.structured``). ``visual_keys`` are
    ``(first placeholder index, content digest)`` of each image and video in prompt order
    (``engine.multimodal.visual_digest``); with ``prefix_state`` (the prefix cache's cursor)
    they are the prefix cache's (``engine.core.prefix_cache``). Requests compare by identity.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    payload: object | None = None
    batch_row: int = -1
    state_slot: int = -1
    history: object | None = None
    grammar: object | None = None
    visual_keys: tuple[tuple[int, bytes], ...] = ()
    prefix_state: object | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache (not computed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a fresh list; O(length))."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token (the one a decode step computes)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens still lack KV."""
        return self.num_computed_tokens < len(self.prompt_token_ids)
