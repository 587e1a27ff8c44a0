"""Bytes and time of one request's transfer: a hybrid model vs a full-attention model of the
same shape.

A hybrid model (Qwen3.5, Qwen3-Next) keeps KV pages for its full-attention layers only (every
``--full-every``-th) and, per linear-attention layer, a fixed-size conv and recurrent state; the
full-attention model of the same shape keeps KV for every layer. For each prompt length this
sends one request's context for real, from pools in this process (a :class:`KVPool` for the KV
layers, a :class:`StatePool` for the linear ones) to pools in a decode process, through
``send_kvcache`` over Mooncake on loopback TCP (pages and, for the hybrid model, its state slot
in the same call), and prints bytes, the median of ``--reps`` sends after a warm-up, GB/s, and
hybrid / full ratios.

Every send is checked: before it the decode zeroes a sample of what it will receive (the first,
middle and last page of every KV entry and the request's slot of every state entry), after it
that sample must equal the source byte for byte, and the bytes the send reports must equal the
shape's analytic count (:meth:`HybridShape.expected_bytes`); so no send is timed that moved
nothing.

The default shape is transformers' ``Qwen3_5TextConfig`` defaults (Qwen3.5-9B-like): 32 layers,
every 4th full attention with 4 KV heads of 256, Gated DeltaNet layers with 16 key and 32 value
heads of 128 and a conv of 4 taps, bfloat16 (the recurrent state float32). The hidden size
(4096) does not enter a request's context. Both pools of a run (this process and the decode)
are sized to the one request; ``--max-gib`` refuses a shape that would need more.

    python -m bench.hybrid_transfer            # 32 layers, 1k, 4k and 16k tokens
    python -m bench.hybrid_transfer --quick    # a small shape, for a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from engine.kv.pool import KVPool
from engine.kv.state_pool import StatePool
from transfer.backends.mooncake import MooncakeKVManager

HOST = "127.0.0.1"
SRC_SLOT, DST_SLOT = 0, 1


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
        """Global ids of the layers with KV (Qwen3.5's ``layer_types``: 3, 7, 11, ...)."""
        if not hybrid:
            return list(range(self.layers))
        return [i for i in range(self.layers) if (i + 1) % self.full_every == 0]

    def linear_layers(self, hybrid: bool) -> list[int]:
        full = set(self.full_layers(hybrid))
        return [i for i in range(self.layers) if i not in full]

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def pools(self, tokens: int, hybrid: bool) -> tuple[KVPool, StatePool | None]:
        """Pools holding exactly one request of ``tokens`` tokens (and two state slots)."""
        dtype = getattr(torch, self.dtype)
        kv = KVPool(self.pages(tokens), self.page_size, self.kv_heads, self.head_dim,
                    self.full_layers(hybrid), dtype)
        linear = self.linear_layers(hybrid)
        if not linear:
            return kv, None
        return kv, StatePool(2, linear, self.conv_channels, self.kernel, self.v_heads,
                             self.k_dim, self.v_dim, dtype)

    def state_bytes(self) -> int:
        """One linear layer's state for one request: the conv window and the recurrent state."""
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.conv_channels * (self.kernel - 1) * elem \
            + self.v_heads * self.k_dim * self.v_dim * 4  # float32

    def expected_bytes(self, tokens: int, hybrid: bool) -> int:
        """Bytes one request moves: its pages of every KV entry (K and V of each full layer)
        and its slot of every linear layer's states."""
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        kv = 2 * len(self.full_layers(hybrid)) * self.pages(tokens) * self.page_size \
            * self.kv_heads * self.head_dim * elem
        return kv + len(self.linear_layers(hybrid)) * self.state_bytes()

    def pool_bytes(self, tokens: int, hybrid: bool) -> int:
        """What one side's pools take (two state slots)."""
        return self.expected_bytes(tokens, hybrid) \
            + len(self.linear_layers(hybrid)) * self.state_bytes()


QUICK = HybridShape(layers=8, kv_heads=2, head_dim=64, k_heads=4, k_dim=32, v_heads=8, v_dim=32)


def _sample(kv: KVPool, states: StatePool | None, slot: int) -> list[torch.Tensor]:
    """Views of what the check compares: the first, middle and last page of every KV entry,
    ``slot`` of every state entry."""
    n = kv.num_pages
    idx = sorted({0, n // 2, n - 1})
    out = [e[i] for e in kv.entries() for i in idx]
    if states is not None:
        out += [states.conv(i)[slot] for i in range(states.num_layers)]
        out += [states.recurrent(i)[slot] for i in range(states.num_layers)]
    return out


def _digest(views: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for v in views:
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _decode_main(conn: Any, shape: HybridShape, tokens: int, hybrid: bool) -> None:
    """The decode process: register the pools, publish them; on ``clear`` zero the sample, on
    ``digest`` answer its digest, until ``stop``."""
    kv, states = shape.pools(tokens, hybrid)
    mgr = MooncakeKVManager(hostname=HOST)
    try:
        mgr.register(kv.buffer_infos(), states=states.buffer_infos() if states else ())
        conn.send((mgr.session_id, mgr.kv_ptrs, mgr.kv_layer_ids, mgr.kv_bytes_per_page,
                   mgr.state_ptrs, mgr.state_layer_ids, mgr.state_bytes_per_slot))
        while (cmd := conn.recv()) != "stop":
            if cmd == "clear":
                for v in _sample(kv, states, DST_SLOT):
                    v.zero_()
                conn.send("ok")
            else:
                conn.send(_digest(_sample(kv, states, DST_SLOT)))
    finally:
        mgr.close()


def _fill(kv: KVPool, states: StatePool | None, seed: int) -> None:
    """Random non-zero-ish bytes in every page and in the source slot, entry by entry."""
    gen = torch.Generator().manual_seed(seed)
    targets = list(kv.entries())
    if states is not None:
        targets += [states.conv(i)[SRC_SLOT] for i in range(states.num_layers)]
        targets += [states.recurrent(i)[SRC_SLOT] for i in range(states.num_layers)]
    for t in targets:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def _recv(conn: Any, proc: Any, what: str, timeout: float = 300.0) -> Any:
    """The decode's next answer; an error naming ``what`` if it exits or stays silent."""
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"the decode process exited (code {proc.exitcode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the decode process gave no {what} in {timeout:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"the decode process exited (code {proc.exitcode}) before "
                           f"{what}") from None


def measure(shape: HybridShape, tokens: int, hybrid: bool, reps: int) -> dict[str, Any]:
    """One request of ``tokens`` tokens sent once to warm up and ``reps`` times timed, every
    send checked on arrival and against the analytic byte count."""
    model = "hybrid" if hybrid else "full"
    expected = shape.expected_bytes(tokens, hybrid)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child, shape, tokens, hybrid), daemon=True)
    proc.start()
    child.close()  # the decode's end lives in the decode only: its exit ends our reads
    mgr: MooncakeKVManager | None = None
    try:
        session, kv_ptrs, kv_ids, kv_bpp, st_ptrs, st_ids, st_bytes = _recv(
            conn, proc, "its buffers")
        kv, states = shape.pools(tokens, hybrid)
        _fill(kv, states, tokens)
        want = _digest(_sample(kv, states, SRC_SLOT))
        mgr = MooncakeKVManager(hostname=HOST)
        mgr.register(kv.buffer_infos(), states=states.buffer_infos() if states else ())
        pages = list(range(kv.num_pages))
        extra: dict[str, Any] = {}
        if states is not None:
            extra = {"src_state_slot": SRC_SLOT, "dst_state_ptrs": st_ptrs,
                     "dst_state_slot": DST_SLOT, "dst_state_layer_ids": st_ids,
                     "dst_state_bytes_per_slot": st_bytes}
        times = []
        for rep in range(reps + 1):  # rep 0 warms up
            conn.send("clear")
            _recv(conn, proc, "clearing the sample")
            t0 = time.perf_counter()
            nbytes = mgr.send_kvcache(session, pages, kv_ptrs, pages, dst_layer_ids=kv_ids,
                                      dst_bytes_per_page=kv_bpp, **extra).nbytes
            dt = time.perf_counter() - t0
            conn.send("digest")
            if _recv(conn, proc, "the sample's digest") != want:
                raise RuntimeError(f"{tokens} tokens ({model}), send {rep}: the bytes on the "
                                   "decode differ from the source")
            if nbytes != expected:
                raise RuntimeError(f"{tokens} tokens ({model}): moved {nbytes} bytes, the "
                                   f"shape says {expected}")
            if rep:
                times.append(dt)
    finally:
        if mgr is not None:
            mgr.close()
        try:
            conn.send("stop")
        except OSError:  # the decode is gone already; the error that got us here says why
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    med = statistics.median(times)
    return {"tokens": tokens, "model": model, "bytes": nbytes, "ms": med * 1e3,
            "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3, "gbps": nbytes / med / 1e9}


def run(shape: HybridShape, token_counts: list[int], reps: int) -> list[dict[str, Any]]:
    """Per token count a hybrid row (with the hybrid / full ratios) and a full row."""
    rows = []
    for tokens in token_counts:
        hyb, full = (measure(shape, tokens, h, reps) for h in (True, False))
        rows += [{**hyb, "bytes_ratio": hyb["bytes"] / full["bytes"],
                  "time_ratio": hyb["ms"] / full["ms"]}, full]
    return rows


def _shape_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"a small shape ({asdict(QUICK)}), 256 and 1024 tokens")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="prompt lengths (default 1024 4096 16384; --quick: 256 1024)")
    ap.add_argument("--reps", type=int, default=3, help="timed sends per row (the median)")
    ap.add_argument("--max-gib", type=float, default=6.0,
                    help="refuse a run whose pools (both sides) would exceed this")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    for f in fields(HybridShape):
        ap.add_argument(_shape_flag(f.name), dest=f.name, type=type(f.default), default=None,
                        help=f"default {f.default} ({getattr(QUICK, f.name)} with --quick)")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else HybridShape()
    shape = replace(base, **{f.name: getattr(args, f.name) for f in fields(HybridShape)
                             if getattr(args, f.name) is not None})
    tokens = args.tokens or ([256, 1024] if args.quick else [1024, 4096, 16384])
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    peak = 2 * max(shape.pool_bytes(t, h) for t in tokens for h in (True, False))
    if peak > args.max_gib * 2**30:
        ap.error(f"the pools would take {peak / 2**30:.2f} GiB (both sides), over --max-gib "
                 f"{args.max_gib}")
    rows = run(shape, tokens, args.reps)
    if args.json:
        print(json.dumps({"shape": asdict(shape), "rows": rows}))
        return rows
    print(f"shape: {asdict(shape)}")
    print(f"state per linear layer and request: {shape.state_bytes()} bytes; median of "
          f"{args.reps} sends")
    print(f"{'tokens':>7} {'model':>7} {'bytes':>13} {'MiB':>9} {'ms':>9} {'min-max ms':>17} "
          f"{'GB/s':>6} {'bytes h/f':>10} {'time h/f':>9}")
    for r in rows:
        ratios = (f"{r['bytes_ratio']:>10.3f} {r['time_ratio']:>9.3f}" if "bytes_ratio" in r
                  else "")
        print(f"{r['tokens']:>7} {r['model']:>7} {r['bytes']:>13,} {r['bytes'] / 2**20:>9.1f} "
              f"{r['ms']:>9.2f} {r['min_ms']:>8.1f}-{r['max_ms']:<8.1f} {r['gbps']:>6.2f} "
              f"{ratios}")
    return rows


if __name__ == "__main__":
    main()
