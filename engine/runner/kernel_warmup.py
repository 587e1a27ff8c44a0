"""Start-up warm-up: one forward per kernel specialisation a worker's eager steps can launch.

Triton compiles a kernel once per *specialisation*: its constexprs (for paged attention the
tile, which :mod:`engine.attention.kernels.configs` picks per dtype, head dim, group and
``max_q``; the decode's split count, picked per batch size; a draft tree's window) and, for each
integer argument not marked ``do_not_specialize``, whether it is 1 or a multiple of 16.
flash-linear-attention autotunes each kernel once per key (head counts, head dims, flags; never
the token count). Left to serving, each new specialisation is compiled, and autotuned, on the
serving thread: every request of that step waits, up to seconds. CUDA graphs cover the decode
steps they capture; everything else runs eagerly: prefill chunks, mixed batches, the decode
steps of a tensor-parallel or hybrid engine (no graphs), a draft tree's forwards. So a worker
runs these forwards of its target model once at start-up (:func:`warm_plan`):

- one sequence of ``q_len`` 2, 4, ... 128 new tokens: the extend kernel's tile grows with
  ``max_q`` (a power of two) up to its widest rows (at most 64), then stays; every prefill chunk,
  mixed batch and chain verify window launches one of these;
- a decode batch of one token per sequence at the smallest batch size of each split count
  (:func:`~engine.attention.kernels.configs.decode_splits`), and at 1, 2 and 16 sequences: a
  library kernel that specialises on the number of sequences sees each class;
- the masked (tree) forwards the caller names, as ``(rows, window)``: a draft tree's ``topk``
  rows over ``i * topk`` window keys at each depth ``i``, a tree verify's ``N`` over ``N``.

A hybrid model's forwards run its linear-attention kernels too: fla's recurrent kernel for
one-token sequences, its chunked one for longer ones.

What the forwards write: K/V on the engine's scratch page only (one page more than the allocator
hands out, already written by padded graph rows), and for a hybrid model state slot 0, zeroed
before each forward. Nothing else changes: every request zeroes its slot, or restores a
checkpoint into it, at its first forward (``engine/runner/model_runner.py``), so what the
warm-up leaves there is never read. With tensor parallelism the other ranks run each forward
with rank 0, so they warm up too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backend import AttentionBatch
from engine.attention.kernels.configs import decode_splits
from engine.models.step_extras import NO_EXTRAS
from engine.parallel.messages import StateStep

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

EXTEND_LENGTHS = (2, 4, 8, 16, 32, 64, 128)  # max_q of each extend tile (widest: 64 rows)
DEFAULT_MAX_SPLITS = 16  # TritonPagedAttention's default, for an engine on another backend
CLASS_SIZES = (1, 2, 16)  # an integer is specialised as 1, a multiple of 16, or neither
STATE_SLOT = 0  # the hybrid state slot the warm-up forwards use (zeroed before each)


@dataclass(frozen=True)
class WarmForward:
    """One warm-up forward: ``num_seqs`` sequences of ``q_len`` new tokens each, causal, or
    under a full ``[num_seqs, q_len, window]`` tree mask when ``window`` is above 0."""

    num_seqs: int
    q_len: int
    window: int = 0


@dataclass(frozen=True)
class KernelWarmUp:
    """What :func:`warm_kernels` ran: how many forwards (``masked`` of them under a tree
    mask), in how long and with how much more device memory reserved, or why none."""

    forwards: int
    seconds: float = 0.0
    masked: int = 0
    memory_bytes: int = 0
    reason: str = ""

    def line(self) -> str:
        """The start-up line a worker prints."""
        if not self.forwards:
            return f"kernels: not warmed ({self.reason})"
        trees = f", {self.masked} under a tree mask" if self.masked else ""
        return (f"kernels: compiled by {self.forwards} warm-up forwards{trees} in "
                f"{self.seconds:.1f} s, {self.memory_bytes / (1 << 20):.0f} MiB")


def warm_plan(engine: LLMEngine, trees: Sequence[tuple[int, int]] = ()) -> list[WarmForward]:
    """The forwards that launch every specialisation ``engine``'s eager steps can (see the
    module docstring); ``trees``: the ``(rows, window)`` of each masked forward."""
    max_seqs = engine.scheduler.config.max_num_seqs
    kv_heads = engine.pool.num_kv_heads
    max_splits = int(getattr(engine.runner.attn, "max_splits", DEFAULT_MAX_SPLITS))
    sizes: dict[int, int] = {}  # split count -> the smallest batch size launching it
    for bs in range(max_seqs, 0, -1):
        sizes[decode_splits(bs, kv_heads, max_splits)] = bs
    batches = sorted({*sizes.values(), *(s for s in CLASS_SIZES if s <= max_seqs)})
    plan = [WarmForward(1, q) for q in EXTEND_LENGTHS]
    plan += [WarmForward(bs, 1) for bs in batches]
    plan += [WarmForward(1, rows, window) for rows, window in sorted(set(trees))]
    return plan


def warm_kernels(engine: LLMEngine, trees: Sequence[tuple[int, int]] = ()) -> KernelWarmUp:
    """Run :func:`warm_plan` on a CUDA engine (elsewhere nothing compiles: say why not)."""
    if engine.device.type != "cuda":
        return KernelWarmUp(0, reason=f"nothing to compile on {engine.device.type}")
    torch.cuda.synchronize()
    before, start = torch.cuda.memory_reserved(), time.perf_counter()
    plan = warm_plan(engine, trees)
    run_plan(engine, plan)
    torch.cuda.synchronize()
    return KernelWarmUp(len(plan), time.perf_counter() - start,
                        sum(1 for fwd in plan if fwd.window),
                        torch.cuda.memory_reserved() - before)


@torch.inference_mode()
def run_plan(engine: LLMEngine, plan: Sequence[WarmForward]) -> None:
    """Run each forward of ``plan`` through ``engine``'s runner (its other tensor-parallel
    ranks included) on the scratch page; the outputs are dropped."""
    for fwd in plan:
        _forward(engine, fwd)


def _forward(engine: LLMEngine, fwd: WarmForward) -> None:
    runner, device = engine.runner, engine.device
    page_size = engine.pool.page_size
    b, q = fwd.num_seqs, fwd.q_len
    kv_len = max(q, fwd.window)
    width = -(-kv_len // page_size)
    table = torch.full((b, width), engine.scratch_page, dtype=torch.int32, device=device)
    # every new token's K/V lands on the scratch page (several tokens may share a slot)
    offsets = np.tile(np.arange(kv_len - q, kv_len) % page_size, b)
    slots = torch.from_numpy(engine.scratch_page * page_size + offsets).to(device)
    batch = AttentionBatch.build([q] * b, [kv_len] * b, table, slots)
    if fwd.window:
        mask = torch.ones(b, q, fwd.window, dtype=torch.bool, device=device)
        batch = replace(batch, tree_mask=mask)
    tokens = b * q
    embeds = engine.model.embed(torch.zeros(tokens, dtype=torch.int64, device=device))
    mrope = torch.zeros(3, tokens, dtype=torch.int64, device=device)
    extras, step = NO_EXTRAS, None
    if engine.states is not None:
        step = StateStep.of([(q, STATE_SLOT, 0)] * b)  # zeroed first (a fresh start)
        extras = replace(extras, states=step.apply(engine.states))
    runner.forward_embeds_aux(embeds, mrope, batch, extras, step)
