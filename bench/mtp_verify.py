"""A hybrid model's speculative verify, one linear-attention layer: keep-rows vs replay.

    python -m bench.mtp_verify                # Qwen3.5-9B-like layer, batch 1 4 8, K 1 3
    python -m bench.mtp_verify --quick        # a small shape, for a smoke run

A verify runs ``n = K + 1`` rows per request (the bonus token and ``K`` drafts) and writes no
state slot until the accepted counts are known (:mod:`engine.attention.linear.states`). In
``rows`` mode each layer keeps the recurrent state after every row and ``keep`` copies the
accepted one; in ``replay`` mode it keeps the rows' inputs to the state update only and ``keep``
steps each slot's state through its accepted rows again. For each batch size and ``K`` this
times one layer's window through :class:`LinearStates` (prepare, conv, delta rule, keep: what
the engine runs per layer) in both modes, alternating, the median of ``--reps`` after a
warm-up, with every request accepting its whole window (replay's most steps) and only its
bonus token (its fewest); ``rows`` keeps the same either way, so it is timed with the whole
window. Ratios are replay / rows of the same run. Before timing, both modes' kept pools are
checked equal byte for byte.

For scale, the same run times the layer's matrix products over the same rows (its fused input
projection, ``out_proj`` and the MLP after it; no norms, no gating): the column ``extra`` is
the time replay adds with whole windows accepted, as a share of those products plus the rows
mode's state work.

Memory is what each mode holds per layer from the window's forward until ``keep``: the state
stack ``[B, n, Hv, Dk, Dv]`` against the inputs (``k``, ``v``, ``g``, ``beta`` per row and value
head), read off the tensors the delta-rule window functions return; the conv's input window
(the same in both modes) beside them; and the three across ``--layers`` linear layers.

The default shape is transformers' ``Qwen3_5TextConfig`` defaults (Qwen3.5-9B-like): hidden
size 4096, 16 key and 32 value heads of 128, a conv of 4 taps, an MLP of 12288, 24 linear
layers; float32 weights, activations and states (the CPU's dtype).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.linear.delta_rule import (
    gated_delta_rule_window,
    gated_delta_rule_window_inputs,
)
from engine.attention.linear.select import TORCH_KERNELS
from engine.attention.linear.states import LinearStates
from engine.config import KEEP_ROWS, REPLAY, VerifyStates
from engine.kv.state_pool import StatePool

MIB = 1 << 20


@dataclass(frozen=True)
class LayerShape:
    """One Gated DeltaNet decoder layer of width ``hidden``: ``k_heads`` x ``k_dim`` queries and
    keys, ``v_heads`` x ``v_dim`` values, a conv of ``kernel`` taps, an MLP of
    ``intermediate``; ``layers`` of them in the model."""

    hidden: int = 4096
    intermediate: int = 12288
    k_heads: int = 16
    v_heads: int = 32
    k_dim: int = 128
    v_dim: int = 128
    kernel: int = 4
    layers: int = 24

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


QUICK = LayerShape(hidden=64, intermediate=128, k_heads=2, v_heads=4, k_dim=16, v_dim=16,
                   layers=4)


class LayerProducts:
    """The layer's matrix products (random float32 weights): the fused input projection (q/k/v,
    z, b, a), ``out_proj``, the MLP's gate/up and down."""

    def __init__(self, shape: LayerShape) -> None:
        s, gen = shape, torch.Generator().manual_seed(7)
        fused = s.conv_channels + s.v_heads * s.v_dim + 2 * s.v_heads
        dims = [(fused, s.hidden), (s.hidden, s.v_heads * s.v_dim),
                (2 * s.intermediate, s.hidden), (s.hidden, s.intermediate)]
        self.weights = [torch.randn(o, i, generator=gen) * i ** -0.5 for o, i in dims]
        self.shape = shape

    def run(self, rows: int) -> None:
        s, (w_in, w_out, w_gate_up, w_down) = self.shape, self.weights
        x = torch.ones(rows, s.hidden)
        F.linear(x, w_in)
        h = F.linear(torch.ones(rows, s.v_heads * s.v_dim), w_out)
        gate, up = F.linear(h, w_gate_up).chunk(2, dim=-1)
        F.linear(F.silu(gate) * up, w_down)


@dataclass
class Window:
    """One layer's verify inputs for ``b`` requests of ``n`` rows, and a pool history."""

    shape: LayerShape
    b: int
    n: int
    seed: int

    def __post_init__(self) -> None:
        s, rows = self.shape, self.b * self.n
        gen = torch.Generator().manual_seed(self.seed)
        self.x = torch.randn(rows, s.conv_channels, generator=gen)
        self.weight = torch.randn(s.conv_channels, s.kernel, generator=gen) * 0.5
        self.q = torch.randn(rows, s.k_heads, s.k_dim, generator=gen)
        self.k = torch.randn(rows, s.k_heads, s.k_dim, generator=gen)
        self.v = torch.randn(rows, s.v_heads, s.v_dim, generator=gen)
        self.g = -torch.rand(rows, s.v_heads, generator=gen)
        self.beta = torch.rand(rows, s.v_heads, generator=gen)
        self.pool = StatePool(self.b, [0], s.conv_channels, s.kernel, s.v_heads, s.k_dim,
                              s.v_dim)
        self.conv0 = torch.randn(self.pool.conv(0).shape, generator=gen)
        self.rec0 = torch.randn(self.pool.recurrent(0).shape, generator=gen) * 0.3
        self.slots = torch.arange(self.b)

    def reset(self) -> None:
        """The pool back to its history (outside the timed part)."""
        self.pool.conv(0).copy_(self.conv0)
        self.pool.recurrent(0).copy_(self.rec0)

    def run(self, states: LinearStates, accepted: torch.Tensor) -> None:
        """What the engine runs for this layer: the window's forward, then keep."""
        states.prepare_window(self.slots, self.n)
        states.conv(0, self.x, self.weight, None)
        states.delta_rule(0, self.q, self.k, self.v, self.g, self.beta)
        states.keep(accepted)

    def held_bytes(self) -> dict[str, int]:
        """What each mode holds per layer until keep: the state stack, the inputs, the conv
        window (both modes), read off the tensors the window functions return."""
        rec, slots = self.pool.recurrent(0), self.slots
        args = (self.q, self.k, self.v, self.g, self.beta, self.n, rec, slots)
        stack = gated_delta_rule_window(*args)[1]
        inputs = gated_delta_rule_window_inputs(*args)[1]
        conv = self.b * self.shape.conv_channels * (self.shape.kernel - 1 + self.n) \
            * self.x.element_size()
        return {"rows_bytes": stack.numel() * stack.element_size(),
                "replay_bytes": inputs.nbytes, "conv_bytes": conv}


def _time_ms(fn: Callable[[], None], reset: Callable[[], None]) -> float:
    """Milliseconds of one ``fn()``, after an untimed ``reset()``."""
    reset()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def check_same_bits(w: Window) -> None:
    """Both modes, from the same history, keep byte-identical pools (a mix of counts)."""
    accepted = torch.arange(w.b) % w.n + 1
    kept = []
    for mode in (KEEP_ROWS, REPLAY):
        w.reset()
        w.run(LinearStates(w.pool, TORCH_KERNELS, mode), accepted)
        kept.append((w.pool.conv(0).clone(), w.pool.recurrent(0).clone()))
    (c0, r0), (c1, r1) = kept
    if not (torch.equal(c0, c1) and torch.equal(r0, r1)):
        raise AssertionError(f"B={w.b} n={w.n}: the modes kept different states")


def measure(shape: LayerShape, products: LayerProducts, b: int, k: int, reps: int
            ) -> dict[str, Any]:
    """One row of the table: batch ``b``, ``k`` drafts."""
    w = Window(shape, b, k + 1, seed=b * 10 + k)
    check_same_bits(w)
    states: dict[VerifyStates, LinearStates] = {
        mode: LinearStates(w.pool, TORCH_KERNELS, mode) for mode in (KEEP_ROWS, REPLAY)}
    whole, bonus = torch.full((b,), w.n), torch.ones(b, dtype=torch.int64)
    cases: dict[str, tuple[VerifyStates, torch.Tensor]] = {
        "rows": (KEEP_ROWS, whole), "replay_all": (REPLAY, whole), "replay_one": (REPLAY, bonus)}
    times: dict[str, list[float]] = {name: [] for name in (*cases, "products")}
    for rep in range(reps + 1):  # the first round warms up
        for name, (mode, accepted) in cases.items():
            def verify(m: VerifyStates = mode, a: torch.Tensor = accepted) -> None:
                w.run(states[m], a)

            took = _time_ms(verify, w.reset)
            if rep:
                times[name].append(took)
        took = _time_ms(lambda: products.run(b * w.n), lambda: None)
        if rep:
            times["products"].append(took)
    ms = {name: statistics.median(t) for name, t in times.items()}
    held = w.held_bytes()
    return {"batch": b, "k": k, "rows_ms": round(ms["rows"], 3),
            "replay_all_ms": round(ms["replay_all"], 3),
            "replay_one_ms": round(ms["replay_one"], 3),
            "ratio_all": round(ms["replay_all"] / ms["rows"], 3),
            "ratio_one": round(ms["replay_one"] / ms["rows"], 3),
            "products_ms": round(ms["products"], 3),
            "extra": round((ms["replay_all"] - ms["rows"]) / (ms["products"] + ms["rows"]), 3),
            **held, "bytes_ratio": held["replay_bytes"] / held["rows_bytes"],
            "layers": shape.layers}


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f}"


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(f"{'B':>2} {'K':>2} {'rows ms':>8} {'replay ms (all/1 acc.)':>22} "
          f"{'ratio all/1':>12} {'matmul ms':>9} {'extra':>6} | {'MiB/layer rows':>14} "
          f"{'replay':>7} {'conv':>6} {'ratio':>6} | {'MiB x L rows':>12} {'replay':>7} "
          f"{'conv':>7}")
    for r in rows:
        n = r["layers"]
        replay = f"{r['replay_all_ms']:.2f} / {r['replay_one_ms']:.2f}"
        ratio = f"{r['ratio_all']:.2f} / {r['ratio_one']:.2f}"
        print(f"{r['batch']:>2} {r['k']:>2} {r['rows_ms']:>8.2f} {replay:>22} {ratio:>12} "
              f"{r['products_ms']:>9.1f} {r['extra']:>6.1%} | "
              f"{_mib(r['rows_bytes']):>14} {_mib(r['replay_bytes']):>7} "
              f"{_mib(r['conv_bytes']):>6} {r['bytes_ratio']:>6.4f} | "
              f"{_mib(n * r['rows_bytes']):>12} {_mib(n * r['replay_bytes']):>7} "
              f"{_mib(n * r['conv_bytes']):>7}")


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3], help="drafts per round")
    parser.add_argument("--reps", type=int, default=15, help="timed runs per case (median)")
    parser.add_argument("--quick", action="store_true", help="a small shape (smoke run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else LayerShape()
    with torch.inference_mode():
        products = LayerProducts(shape)
        rows = [measure(shape, products, b, k, args.reps) for b in args.batch for k in args.k]
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, shape {shape}")
        print_table(rows)
    return rows


if __name__ == "__main__":
    main()
