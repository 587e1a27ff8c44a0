"""What a prefill's matrix products could reach on this machine, to read its time against.

A prefill of ``b`` prompts of ``L`` tokens multiplies every decoder weight by ``b * L`` rows and
the LM head by ``b`` rows (the last token of each prompt), so it costs at least
:func:`prefill_flops` floating-point operations; attention over 128-token prompts adds a few
percent that are not counted. :func:`gemm_gflop_s` is the rate of one large matrix product of
the decoder's widest shape (the gate/up projection over 4,096 rows, through the same oneDNN
path the engine uses): with both engines' prefills near it, no engine is much faster on the
same hardware at the same precision.
"""

from __future__ import annotations

import time

import torch

from engine.llm_engine import LLMEngine
from engine.models.linear import PreparedLinear
from engine.models.qwen2_vl.model import MLP_CHUNK_ROWS

GEMM_ROWS = 4096


def decoder_linear_params(engine: LLMEngine) -> int:
    """Weights of the decoder layers' projections (fused ones counted once)."""
    return sum(lin.out_features * lin.in_features
               for layer in engine.model.model.layers.modules()
               for lin in vars(layer).values() if isinstance(lin, PreparedLinear))


def prefill_flops(engine: LLMEngine, batch: int, prompt_len: int) -> int:
    """Multiply-adds x 2 of the projections and the LM head in a prefill of ``batch`` prompts
    of ``prompt_len`` tokens."""
    head = engine.model.lm_head.weight
    return 2 * (decoder_linear_params(engine) * batch * prompt_len + head.shape[0]
                * head.shape[1] * batch)


def gemm_gflop_s(out_features: int, in_features: int, dtype: torch.dtype) -> float:
    """GFLOP/s of a prepared ``[out, in]`` linear over :data:`GEMM_ROWS` rows, in chunks of
    the MLP's (:data:`MLP_CHUNK_ROWS`, as the engine runs its widest product); the best of
    four passes."""
    gen = torch.Generator().manual_seed(0)
    linear = PreparedLinear((torch.randn(out_features, in_features, generator=gen) * 0.02)
                            .to(dtype))
    x = torch.randn(GEMM_ROWS, in_features, generator=gen).to(dtype)
    chunks = x.split(MLP_CHUNK_ROWS)
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        for part in chunks:
            linear(part)
        best = min(best, time.perf_counter() - start)
    return 2 * GEMM_ROWS * out_features * in_features / best / 1e9
