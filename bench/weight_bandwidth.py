"""How close a batch-1 decode step comes to the machine's memory bandwidth, measured in one run.

At one token a decode step reads every weight of the decoder and the LM head once and does
little else, so its speed is bounded by how fast the memory streams those bytes. Two figures,
taken alternately three times each (best of each kept, so a busy moment of the machine spoils
neither alone):

- the decode step: ``(generate(new) - generate(1)) / (new - 1)`` at batch 1 on one prompt (fresh
  prompts, so both calls prefill the same way), against the bytes of the weights a step reads;
- a plain streaming read of as many bytes: ``Tensor.sum()`` over a buffer of that size in the
  model's dtype, which no matrix product can beat by much.

The ratio of the two is the share of the bandwidth the step uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.models.linear import PreparedLinear


@dataclass(frozen=True)
class Bandwidth:
    step_ms: float
    weight_bytes: int
    stream_gb_s: float

    @property
    def step_gb_s(self) -> float:
        return self.weight_bytes / self.step_ms / 1e6

    @property
    def ratio(self) -> float:
        return self.step_gb_s / self.stream_gb_s


def decode_weight_bytes(engine: LLMEngine) -> int:
    """Bytes a one-token decode step reads: the decoder's weights and the LM head (the
    embedding is read one row a token; the vision tower not at all)."""
    model = engine.model
    decoder = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    # packed weights are no parameters (their plain ones are empty); plain ones are counted above
    prepared = sum(lin.out_features * lin.in_features * model.dtype.itemsize
                   for layer in model.model.layers.modules()
                   for lin in vars(layer).values()
                   if isinstance(lin, PreparedLinear) and lin.packed)
    head = model.lm_head.weight
    return decoder + prepared + head.numel() * head.element_size()


def stream_gb_s(nbytes: int, dtype: torch.dtype) -> float:
    """GB/s of ``sum()`` over a fresh buffer of ``nbytes`` (best of three)."""
    buf = torch.ones(nbytes // dtype.itemsize, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def measure(engine: LLMEngine, prompt_len: int, new: int, vocab: int) -> Bandwidth:
    """See the module docstring; prompts are drawn fresh for every call."""
    from bench.random_prompts import prompts

    def timed(tokens: int, seed: int) -> float:
        ids = prompts(1, prompt_len, vocab, seed=seed)[0]
        start = time.perf_counter()
        engine.generate([Prompt(token_ids=ids)],
                        SamplingParams(max_new_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start

    nbytes = decode_weight_bytes(engine)
    steps, streams = [], []
    for rep in range(3):
        whole, first = timed(new, 100 + 2 * rep), timed(1, 101 + 2 * rep)
        steps.append((whole - first) / (new - 1) * 1000)
        streams.append(stream_gb_s(nbytes, engine.model.dtype))
    return Bandwidth(min(steps), nbytes, max(streams))
