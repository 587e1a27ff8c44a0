"""Bytes and time of one request's transfer: a hybrid model vs a full-attention model of the
same shape.

A hybrid model (Qwen3.5, Qwen3-Next) keeps KV pages for its full-attention layers only (every
``--full-every``-th) and, per linear-attention layer, a fixed-size conv and recurrent state; the
full-attention model of the same shape keeps KV for every layer. For each prompt length this
sends one request's context for real, from pools in this process to pools in a decode process,
through ``send_kvcache`` over Mooncake on loopback TCP (pages and, for the hybrid model, its
state slot in the same call), checks that the bytes landed (the last page of every entry and
every state entry's slot, compared with the source), and prints bytes, the fastest of
``--reps`` sends, GB/s, and hybrid / full ratios.

    python -m bench.hybrid_transfer            # 32 layers, 1k, 4k and 16k tokens
    python -m bench.hybrid_transfer --quick    # a small shape, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.kv.pool import KVPool
from engine.kv.state_pool import StatePool
from transfer.backends.mooncake import MooncakeKVManager

HOST = "127.0.0.1"


@dataclass(frozen=True)
class HybridShape:
    """A model's context shape: ``layers`` decoder layers, every ``full_every``-th full
    attention (``kv_heads`` x ``head_dim``), the others Gated DeltaNet (``k_heads`` x
    ``k_dim`` keys, ``v_heads`` x ``v_dim`` values, a conv of ``kernel`` taps)."""

    layers: int = 32
    full_every: int = 4
    kv_heads: int = 4
    head_dim: int = 256
    k_heads: int = 16
    k_dim: int = 128
    v_heads: int = 32
    v_dim: int = 128
    kernel: int = 4
    page_size: int = 16
    dtype: str = "bfloat16"

    def full_layers(self, hybrid: bool) -> list[int]:
        if not hybrid:
            return list(range(self.layers))
        return [i for i in range(self.layers) if (i + 1) % self.full_every == 0]

    def linear_layers(self, hybrid: bool) -> list[int]:
        full = set(self.full_layers(hybrid))
        return [i for i in range(self.layers) if i not in full]

    def pools(self, tokens: int, hybrid: bool) -> tuple[KVPool, StatePool | None]:
        dtype = getattr(torch, self.dtype)
        pages = -(-tokens // self.page_size)
        kv = KVPool(pages, self.page_size, self.kv_heads, self.head_dim,
                    self.full_layers(hybrid), dtype)
        linear = self.linear_layers(hybrid)
        if not linear:
            return kv, None
        channels = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        return kv, StatePool(2, linear, channels, self.kernel, self.v_heads, self.k_dim,
                             self.v_dim, dtype)

    def expected_bytes(self, tokens: int, hybrid: bool) -> int:
        """Bytes one request moves: its pages of every KV entry, and one state slot."""
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        pages = -(-tokens // self.page_size)
        kv = 2 * len(self.full_layers(hybrid)) * pages * self.page_size * self.kv_heads \
            * self.head_dim * elem
        channels = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        state = channels * (self.kernel - 1) * elem + self.v_heads * self.k_dim * self.v_dim * 4
        return kv + len(self.linear_layers(hybrid)) * state


def _entries(kv: KVPool, states: StatePool | None) -> list[torch.Tensor]:
    out = kv.entries()
    if states is not None:
        n = states.num_layers
        out += [states.conv(i) for i in range(n)] + [states.recurrent(i) for i in range(n)]
    return out


def _probe(kv: KVPool, states: StatePool | None, slot: int) -> list[bytes]:
    """What the check compares: the last page of every KV entry, ``slot`` of every state."""
    out = [e[-1].contiguous().view(torch.uint8).numpy().tobytes() for e in kv.entries()]
    if states is not None:
        out += [e[slot].contiguous().view(torch.uint8).numpy().tobytes()
                for e in _entries(kv, states)[len(kv.entries()):]]
    return out


def _decode_main(conn: Any, shape: HybridShape, tokens: int, hybrid: bool) -> None:
    """The decode process: register the pools, publish them, answer probes until stopped."""
    kv, states = shape.pools(tokens, hybrid)
    mgr = MooncakeKVManager(hostname=HOST)
    mgr.register(kv.buffer_infos(), states=states.buffer_infos() if states else ())
    conn.send((mgr.session_id, mgr.kv_ptrs, mgr.kv_layer_ids, mgr.kv_bytes_per_page,
               mgr.state_ptrs, mgr.state_layer_ids, mgr.state_bytes_per_slot))
    while conn.recv() == "probe":
        conn.send(_probe(kv, states, 1))


def measure(shape: HybridShape, tokens: int, hybrid: bool, reps: int) -> dict[str, Any]:
    """One request of ``tokens`` tokens sent ``reps`` times (after a warm-up); checked."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child, shape, tokens, hybrid), daemon=True)
    proc.start()
    try:
        session, kv_ptrs, kv_ids, kv_bpp, st_ptrs, st_ids, st_bytes = conn.recv()
        kv, states = shape.pools(tokens, hybrid)
        gen = torch.Generator().manual_seed(tokens)
        for e in _entries(kv, states):
            e.copy_(torch.randn(e.shape, generator=gen).to(e.dtype))
        mgr = MooncakeKVManager(hostname=HOST)
        mgr.register(kv.buffer_infos(), states=states.buffer_infos() if states else ())
        pages = list(range(kv.num_pages))
        extra: dict[str, Any] = {}
        if states is not None:
            extra = {"src_state_slot": 0, "dst_state_ptrs": st_ptrs, "dst_state_slot": 1,
                     "dst_state_layer_ids": st_ids, "dst_state_bytes_per_slot": st_bytes}

        def send() -> int:
            return mgr.send_kvcache(session, pages, kv_ptrs, pages, dst_layer_ids=kv_ids,
                                    dst_bytes_per_page=kv_bpp, **extra).nbytes

        nbytes = send()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            send()
            times.append(time.perf_counter() - t0)
        conn.send("probe")
        landed = conn.recv() == _probe(kv, states, 0)
    finally:
        conn.send("stop")
        proc.join(10)
    if not landed:
        raise RuntimeError(f"{tokens} tokens ({'hybrid' if hybrid else 'full'}): the bytes "
                           "on the decode differ from the source")
    if nbytes != shape.expected_bytes(tokens, hybrid):
        raise RuntimeError(f"moved {nbytes} bytes, expected {shape.expected_bytes(tokens, hybrid)}")
    best = min(times)
    return {"tokens": tokens, "model": "hybrid" if hybrid else "full", "bytes": nbytes,
            "ms": best * 1e3, "gbps": nbytes / best / 1e9}


def run(shape: HybridShape, token_counts: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for tokens in token_counts:
        hyb, full = (measure(shape, tokens, h, reps) for h in (True, False))
        rows += [{**hyb, "bytes_ratio": hyb["bytes"] / full["bytes"],
                  "time_ratio": hyb["ms"] / full["ms"]}, full]
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 layers of a small shape, 256 and 1024 tokens")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.quick:
        shape = HybridShape(layers=8, kv_heads=2, head_dim=64, k_heads=4, k_dim=32, v_heads=8,
                            v_dim=32)
        tokens = [256, 1024] if args.tokens == ap.get_default("tokens") else args.tokens
    else:
        shape, tokens = HybridShape(layers=args.layers), args.tokens
    rows = run(shape, tokens, args.reps)
    if args.json:
        print(json.dumps({"shape": asdict(shape), "rows": rows}))
        return rows
    print(f"shape: {asdict(shape)}")
    print(f"{'tokens':>7} {'model':>7} {'MiB':>10} {'ms':>9} {'GB/s':>7} {'bytes h/f':>10} "
          f"{'time h/f':>9}")
    for r in rows:
        ratios = (f"{r['bytes_ratio']:>10.3f} {r['time_ratio']:>9.3f}" if "bytes_ratio" in r
                  else "")
        print(f"{r['tokens']:>7} {r['model']:>7} {r['bytes'] / 2**20:>10.1f} {r['ms']:>9.2f} "
              f"{r['gbps']:>7.2f} {ratios}")
    return rows


if __name__ == "__main__":
    main()
